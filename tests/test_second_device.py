"""The GPU's code paths on CPU-only CI: every mode, the star, pre-speculation, several drafters
and the pipeline on a second device (tests.second_device: a tensor left on the host beside the
device's fails as on CUDA). fp32 outputs equal the CPU's token for token; the tests that need
CUDA itself (graphs, flashinfer, events, bf16 kernels) stay in test_gpu.py."""


from dataclasses import replace

import pytest
import torch

from specctl.engine.fusion import fuse_projections
from specctl.engine.loader import load_decoder
from specctl.engine.tree import TokenTree
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate
from specctl.spec.sampling import sample
from tests import test_gpu
from tests.second_device import DeviceMismatch, patch_factories, second_device
from tests.test_gpu import PROMPTS

MODES = ["ar", "chain", "tree", "ngram"]


@pytest.fixture
def device(monkeypatch):
    patch_factories(monkeypatch)
    return second_device()


def _on(path, device, static: bool):
    decoder = fuse_projections(load_decoder(path, torch.float32, device=device))
    return decoder.use_static_steps(graphs=False) if static else decoder


def _drafter(mode: str, draft):
    return {"ar": None, "chain": ModelChainDrafter(draft, 4), "tree": ModelTreeDrafter(draft, 3, 2, 3),
            "ngram": NgramDrafter(4)}[mode]


def test_the_device_fails_a_host_tensor_beside_its_own_as_cuda_does(device):
    """What the tests below rely on: a CPU operand fails, what CUDA takes passes."""
    on = torch.arange(4.0, device=device)
    with pytest.raises(DeviceMismatch, match="Expected all tensors to be on the same device"):
        on + torch.ones(4)
    with pytest.raises(DeviceMismatch, match="generator"):
        torch.multinomial(on + 1, 1, generator=torch.Generator().manual_seed(0))
    assert (on + torch.tensor(1.0)).device == device  # a 0-dim host scalar
    assert on[torch.tensor([0, 2])].tolist() == [0.0, 2.0]  # host index tensors
    assert on.cpu().device.type == "cpu" and on.sum().item() == 6.0 and on.to("cpu").tolist() == [0, 1, 2, 3]


# tree and ngram eager in --runslow: every mode on static steps (CUDA's own) and ar and chain eager by default
@pytest.mark.parametrize("mode, static", [
    pytest.param(mode, static, id=f"{mode}-{'static' if static else 'eager'}",
                 marks=pytest.mark.slow if mode in ("tree", "ngram") and not static else ())
    for mode in MODES for static in (False, True)])
def test_every_mode_on_the_device_greedy_equals_the_target_alone_and_sampled_is_seeded(tiny_dir, device, mode, static):
    """Greedy: the target alone's tokens on the device, which are the CPU's (fp32). Sampled: the
    same seed, the same tokens (the device's last bits are not the CPU's: a static step on
    the CPU takes its row-exact products, so a draw may land elsewhere)."""
    target, draft = _on(tiny_dir["qwen2"], device, static), _on(tiny_dir["qwen2-draft"], device, static)
    cpu_target = _on(tiny_dir["qwen2"], "cpu", static)
    assert target.embed_tokens.weight.device == device
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in PROMPTS[:2]:
        reference = generate(target, prompt, greedy)[0]
        assert reference == generate(cpu_target, prompt, greedy)[0]
        assert generate(target, prompt, greedy, _drafter(mode, draft))[0] == reference, (mode, prompt)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=24, ignore_eos=True, seed=5)
    first, _, reason = generate(target, PROMPTS[0], sampled, _drafter(mode, draft))
    assert len(first) == 24 and reason == "length"
    assert generate(target, PROMPTS[0], sampled, _drafter(mode, draft))[0] == first


@pytest.mark.parametrize("mode", ["chain", pytest.param("tree", marks=pytest.mark.slow)])
def test_logit_rules_structure_and_logprobs_on_the_device_equal_the_target_alone(tiny_dir, device, mode):
    """Penalties over a window, a bias, min_tokens and stop ids (the rules' state on the device),
    a grammar's masks applied to device logits, logprobs and the prompt's, a thinking budget:
    every mode the target alone's tokens, their log-probabilities the CPU's."""
    from specctl.engine.tiny import make_byte_tokenizer
    from specctl.spec.rounds import run_to_end

    target, draft = _on(tiny_dir["qwen2"], device, True), _on(tiny_dir["qwen2-draft"], device, True)
    cpu_target = _on(tiny_dir["qwen2"], "cpu", True)
    tokenizer = make_byte_tokenizer()
    cases = [
        (SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.4,
                        repetition_penalty=1.6, min_tokens=8, stop_token_ids=(11,), logit_bias=((5, -100.0), (7, 2.0)),
                        penalty_last_n=4, logprobs=2, prompt_logprobs=1), {}),
        (SamplingParams(max_tokens=30, structured=("regex", r"[a-c]{2,5}-\d{3}")),
         {"eos_token_ids": (256,), "tokenizer": tokenizer}),
        (SamplingParams(max_tokens=30, structured=("choice", '["north", "south", "east"]')),
         {"eos_token_ids": (256,), "tokenizer": tokenizer}),
        (SamplingParams(max_tokens=16, ignore_eos=True, thinking_budget=2, thinking_markers=((20,), (21,))), {}),
    ]
    sampled = SamplingParams(max_tokens=30, temperature=0.9, seed=4, structured=("choice", '["north", "south"]'))
    for seed in range(3):
        output = run_to_end(target, PROMPTS[0], replace(sampled, seed=seed), _drafter(mode, draft),
                            eos_token_ids=(256,), tokenizer=tokenizer).output
        assert tokenizer.decode(output) in ("north", "south")
    for params, options in cases:
        for prompt in PROMPTS[:2]:
            alone = run_to_end(target, prompt + [20], params, **options)
            got = run_to_end(target, prompt + [20], params, _drafter(mode, draft), **options)
            on_cpu = run_to_end(cpu_target, prompt + [20], params, **options)
            assert got.output == alone.output == on_cpu.output, (params, prompt)
            for (lp, ids, values, rank), (cpu_lp, cpu_ids, cpu_values, cpu_rank) in zip(got.logprobs, on_cpu.logprobs,
                                                                                         strict=True):
                assert (ids, rank) == (cpu_ids, cpu_rank) and lp == pytest.approx(cpu_lp, abs=1e-4)
                assert values == pytest.approx(cpu_values, abs=1e-4)
            got_prompt, cpu_prompt = got.prompt_logprobs or [], on_cpu.prompt_logprobs or []
            assert [e[1] for e in got_prompt] == [e[1] for e in cpu_prompt]
            assert [e[0] for e in got_prompt] == pytest.approx([e[0] for e in cpu_prompt], abs=1e-4)


@pytest.mark.parametrize("mode", ["ar", "chain", "tree"])
def test_prefix_cache_resumed_and_chunked_prefills_on_the_device_keep_the_output(tiny_dir, device, mode):
    target = _on(tiny_dir["qwen2"], device, True).use_prefix_cache(64 << 20)
    draft = _on(tiny_dir["qwen2-draft"], device, True)
    params = SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=0.5)
    whole = generate(target, PROMPTS[3], params)[0]
    again, stats, _ = generate(target, PROMPTS[3] + whole + [5, 9], params, _drafter(mode, draft))
    assert stats.cached_prompt_tokens >= len(PROMPTS[3])
    target.prefix_cache = None
    assert again == generate(target, PROMPTS[3] + whole + [5, 9], params)[0]
    assert generate(target, PROMPTS[3], params, _drafter(mode, draft), resumed=tuple(whole[:7]))[0] == whole
    target.prefill_chunk = 16
    assert generate(target, PROMPTS[3], params, _drafter(mode, draft))[0] == whole


def test_a_batch_on_the_device_equals_each_session_alone(tiny_dir, device):
    """Batched steps of three sessions on the device, each row its session's alone (to the last
    bits on CUDA graphs, test_gpu; an eager batch's products here differ past 1e-5 at most)."""
    decoder = _on(tiny_dir["qwen2"], device, True)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]

    def fresh():
        caches = [decoder.new_cache(128) for _ in prompts]
        for prompt, cache in zip(prompts, caches):
            decoder(torch.tensor(prompt, device=device), torch.arange(len(prompt), device=device), cache)
        return caches

    steps = [(torch.tensor([11], device=device), torch.tensor([len(p)], device=device)) for p in prompts]
    at = [torch.tensor([0], device=device)] * 3
    together = decoder.forward_many([s[0] for s in steps], [s[1] for s in steps], fresh(), [None] * 3, at)
    alone = [decoder(tokens, positions, cache, logits_at=at[0]) for (tokens, positions), cache in zip(steps, fresh())]
    assert all(a.device == device and torch.allclose(a.cpu(), b.cpu(), atol=1e-5) for a, b in zip(together, alone))


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss",
                                  "glm4_moe", "deepseek_v3", "llama4"])
def test_families_on_the_device_equal_the_cpu(tiny_dir, device, arch):
    """MoE routing, latent attention (MLA), sinks, windows and their masks on the device."""
    draft = f"{arch}-draft" if f"{arch}-draft" in tiny_dir else arch
    target, cpu = _on(tiny_dir[arch], device, True), _on(tiny_dir[arch], "cpu", True)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for prompt in PROMPTS[:2]:
        reference = generate(cpu, prompt, params)[0]
        assert generate(target, prompt, params)[0] == reference
        drafter = ModelChainDrafter(_on(tiny_dir[draft], device, True), 3)
        assert generate(target, prompt, params, drafter)[0] == reference


@pytest.mark.parametrize("mode", ["ar", "chain", pytest.param("tree", marks=pytest.mark.slow)])
def test_sessions_over_a_kv_arena_with_paged_attention_on_the_device_equal_the_target_alone(tiny_dir, device, mode):
    """The arena (one buffer for every session) and the paged attention's page table on the device."""
    target = _on(tiny_dir["qwen2"], device, False).use_kv_arena(1 << 20, attention="torch")
    draft = _on(tiny_dir["qwen2-draft"], device, False).use_kv_arena(1 << 20, attention="torch")
    plain = _on(tiny_dir["qwen2"], device, False)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in PROMPTS:
        assert generate(target, prompt, params, _drafter(mode, draft))[0] == generate(plain, prompt, params)[0]
    assert target.paged.plans > 0 and target.kv_arena.free_slots == target.kv_arena.slots


def test_tree_growth_and_sampling_take_device_probabilities(device):
    probs = torch.tensor([[0.1, 0.6, 0.3, 0.0]], device=device)
    tree = TokenTree.root(3).grow(torch.tensor([0]), probs, topk=2, width=2)
    assert tree.tokens.tolist() == [3, 1, 2] and tree.tokens.device.type == "cpu"
    generator = torch.Generator().manual_seed(0)
    assert {sample(probs[0], generator) for _ in range(100)} <= {0, 1, 2}


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
async def test_the_star_on_the_device_equals_the_target(tiny_dir, device, tree):
    await test_gpu.star_run(tiny_dir, device, tree)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
async def test_the_star_with_logit_rules_on_the_device_equals_the_target(tiny_dir, device, tree):
    """Five sessions verified in batches, each with its rules' state on the device."""
    await test_gpu.star_run(tiny_dir, device, tree, rules={"repetition_penalty": 1.5, "presence_penalty": 0.4,
                                                            "logit_bias": ((7, 3.0),), "min_tokens": 4})


@pytest.mark.parametrize("tree", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["chain", "tree"])
async def test_the_star_capped_by_load_on_the_device_equals_the_target(tiny_dir, device, tree):
    """Five sessions at once past a schedule's first step: proposals cut to 2 levels per session."""
    await test_gpu.star_run(tiny_dir, device, tree, spec_depth_by_load=((2, 2),))


@pytest.mark.parametrize("caps, tree", [((), False), ((), True), (((1, 2),), False),
                                        pytest.param(((1, 2),), True, marks=pytest.mark.slow)],
                         ids=["chain", "tree", "chain-capped", "tree-capped"])
async def test_a_prespec_draft_server_on_the_device_equals_the_target(tiny_dir, device, tree, caps):
    """Branches batched with the tree mask, hits' KV made the session's, Saguaro C < 1; capped: a
    hit deeper than the target's cap cut to its first levels (and its KV to the nodes they feed)."""
    from specctl.draft.prespec_config import PrespecConfig

    await test_gpu.star_run(tiny_dir, device, tree, PrespecConfig(budget=6, saguaro_c=0.5, fallback="jit",
                                                                  adaptive=False), spec_depth_by_load=caps)


def test_several_drafters_and_predicted_outputs_on_the_device_equal_the_target(tiny_dir, device):
    test_gpu.several_drafters_run(tiny_dir, device)
    test_gpu.predicted_outputs_run(tiny_dir, device)


async def test_pp_specpipe_and_a_specpipe_target_through_device_stages_equal_the_target(tiny_dir, device):
    """Stage outputs come back over TCP to the host: the logits go to stage 1's device, where
    the session's rules are (penalties and a bias failed here before they did)."""
    await test_gpu.pipeline_chain_run(tiny_dir, device)
    await test_gpu.pipeline_chain_run(tiny_dir, device, SamplingParams(max_tokens=24, ignore_eos=True,
                                                                      repetition_penalty=1.6, logit_bias=((7, 4.0),)))
    await test_gpu.specpipe_rules_run(tiny_dir, device)
    await test_gpu.specpipe_target_prediction_run(tiny_dir, device)
