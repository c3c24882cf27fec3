"""engine.decode_step: one-token CPU steps as straight-line code give the modules' bits exactly
(logits and KV, step after step), for every family whose layers it takes, in each dtype and
quantization a CPU model runs in; any other decoder, or step, goes through the modules."""

import pytest
import torch

from specctl.config import Config
from specctl.engine import decode_step
from specctl.engine.decode_step import DecodeStep
from specctl.engine.loader import load_decoder
from specctl.engine.quant import quantize_decoder
from specctl.errors import ConfigError
from specctl.spec.factory import load_named
from tests.conftest import TINY_ARCHS

STEPPED = ("llama", "qwen2", "qwen3", "phi3")  # Llama's layer (Qwen3's per-head q/k norms; Phi-4-mini's partial RoPE)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_it_takes_exactly_the_families_of_llama_s_layer(tiny, arch):
    assert decode_step.fits(tiny[arch]) is (arch in STEPPED)


def test_a_pipeline_stage_or_a_static_decoder_keeps_the_modules(tiny_dir):
    assert not decode_step.fits(load_decoder(tiny_dir["llama"], layer_range=(0, 1), head=False))
    assert not decode_step.fits(load_decoder(tiny_dir["llama"], layer_range=(1, 2), embed=False))
    static = load_decoder(tiny_dir["llama"]).use_static_steps(graphs=False)
    assert not decode_step.fits(static) and static.use_decode_step().decode_step is None


def _two_ways(decoder, steps: int = 12, prompt: int = 21, seed: int = 0, sessions: int = 1) -> int:
    """Greedy steps of ``sessions`` sessions (prompts of their own lengths) after their prefills,
    a token each a step in one forward_many, through the decode step and through the modules on
    caches of their own: each session's logits and each layer's keys and values equal at every
    step. Returns the forwards the decode step ran."""
    stepper, ran = decoder.decode_step, []
    assert stepper is not None
    original = stepper.run

    def counted(*args):
        ran.append(1)
        return original(*args)

    stepper.run = counted
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, decoder.spec.vocab_size, (prompt + 5 * s,), generator=gen) for s in range(sessions)]
    caches = {way: [decoder.new_cache(len(ids) + steps + 1) for ids in prompts] for way in ("step", "modules")}
    with torch.inference_mode():
        for way in caches:
            for ids, cache in zip(prompts, caches[way]):
                decoder.forward(ids, torch.arange(len(ids)), cache)
        assert len(ran) == 0  # a prefill goes through the modules
        tokens = [ids[-1:] for ids in prompts]
        at = [torch.tensor([0])] * sessions
        for _ in range(steps):
            outs = {}
            for way, runner in (("step", stepper), ("modules", None)):
                decoder.decode_step = runner
                positions = [torch.tensor([cache.length]) for cache in caches[way]]
                outs[way] = decoder.forward_many(tokens, positions, caches[way], [None] * sessions, at)
            decoder.decode_step = stepper
            for mine, theirs, cache, other in zip(outs["step"], outs["modules"], caches["step"], caches["modules"]):
                assert torch.equal(mine, theirs) and cache.length == other.length
                assert torch.equal(cache.kv[..., : cache.length, :], other.kv[..., : other.length, :])
            tokens = [out.argmax(-1) for out in outs["step"]]
    return len(ran)


@pytest.mark.parametrize("arch", STEPPED)
def test_fp32_steps_give_the_modules_bits(tiny, arch):
    decoder = tiny[arch]
    try:
        decoder.use_decode_step()
        assert _two_ways(decoder) == 12
        assert _two_ways(decoder, sessions=3) == 12  # a draft server's batched step
    finally:
        decoder.decode_step = None


@pytest.mark.parametrize("arch", STEPPED)
def test_int8_steps_give_the_modules_bits(tiny_dir, arch):
    decoder = quantize_decoder(load_decoder(tiny_dir[arch], torch.bfloat16), "int8").use_decode_step()
    assert _two_ways(decoder, seed=1) == 12
    assert _two_ways(decoder, seed=1, sessions=3) == 12


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("arch", STEPPED)
def test_a_half_precision_target_as_loaded_steps_with_the_modules_bits(tiny_dir, arch, dtype):
    """As load_named makes a CPU target: packed (bf16), rows probed and padded, row-exact attention."""
    decoder = load_named(str(tiny_dir[arch]), Config(dtype=dtype), target=True).decoder
    assert decoder.decode_step is not None
    assert _two_ways(decoder, seed=2) == 12
    assert _two_ways(decoder, seed=2, sessions=2) == 12


def test_load_named_steps_a_llama_shaped_cpu_model_unless_configured_off(tiny_dir):
    assert load_named(str(tiny_dir["qwen2"]), Config(), quant="int8").decoder.decode_step is not None
    assert load_named(str(tiny_dir["qwen2"]), Config(decode_step=False)).decoder.decode_step is None
    assert load_named(str(tiny_dir["gemma2"]), Config()).decoder.decode_step is None
    stage = load_named(str(tiny_dir["llama"]), Config(), stage=((0, 1), True, False)).decoder
    assert stage.decode_step is None
    with pytest.raises(ConfigError, match="decode_step must be true or false, got 'yes'"):
        Config(decode_step="yes")


def test_masked_or_longer_forwards_go_through_the_modules_and_a_token_a_session_through_the_step(tiny_dir):
    decoder = load_decoder(tiny_dir["llama"]).use_decode_step()
    calls = []

    def recording(self, ids, positions, caches, rows):
        calls.append(len(caches))
        return torch.zeros(len(ids), 1)

    decoder.decode_step = type("Recording", (DecodeStep,), {"run": recording})(decoder)
    one = torch.tensor([0])
    with torch.inference_mode():
        caches = [decoder.new_cache(16) for _ in range(2)]
        decoder.forward(torch.tensor([3, 4]), torch.arange(2), caches[0])  # two tokens
        decoder.forward(torch.tensor([5]), torch.tensor([2]), caches[0], mask=torch.ones(1, 3, dtype=torch.bool))
        decoder.forward_many([torch.tensor([3]), torch.tensor([4])], [torch.tensor([3]), torch.tensor([0])], caches,
                             [torch.ones(1, 4, dtype=torch.bool), None], [one, one])  # one of them masked
        decoder.forward_ragged(torch.tensor([3, 4, 5]), torch.tensor([4, 1, 2]), [(0, 1), (1, 3)], caches,
                               [None, None], torch.tensor([0, 2]))  # a token in one session, two in the other
        assert calls == [] and [cache.length for cache in caches] == [5, 3]
        decoder.forward(torch.tensor([6]), torch.tensor([5]), caches[0])
        decoder.forward_many([torch.tensor([3]), torch.tensor([4])], [torch.tensor([5]), torch.tensor([3])], caches,
                             [None, None], [one, one])
        assert calls == [1, 2]
