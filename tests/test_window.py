"""Sliding-window layers (engine.window): transformers' logits past the window for every family
that slides, and every mode's output equal to the target alone's there (fp32, bf16 row-exact,
static steps, sessions verified together)."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from specctl.engine.families import layer_windows
from specctl.engine.fusion import fuse_projections
from specctl.engine.loader import load_decoder
from specctl.engine.spec import ModelSpec
from specctl.engine.tiny import make_tiny_model, tiny_config
from specctl.engine.window import window_cut, window_rows
from specctl.errors import UnsupportedArchitecture
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate
from specctl_kernels import causal_mask
from tests.conftest import GEMMA2_CAPS, verified_together_equal_alone

WINDOW = 24


def _mistral(path, seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           sliding_window=WINDOW, initializer_range=0.1)
    MistralForCausalLM(config).save_pretrained(path)
    return path


def _sliding(path, arch: str, seed: int = 0, layers: int = 4):
    """A tiny checkpoint of ``arch`` whose sliding layers (as that family slides them) have a
    24-token window."""
    if arch == "mistral":
        return _mistral(path, seed, layers)
    extra = {"phi3": {}, "gemma2": {"norm_std": 0.3, **GEMMA2_CAPS},
             "qwen2": {"use_sliding_window": True, "max_window_layers": layers // 2},
             "qwen3": {"use_sliding_window": True, "max_window_layers": layers // 2, "norm_std": 0.3},
             "olmo3": {"norm_std": 0.3}, "starcoder2": {"norm_std": 0.3, "bias_std": 0.1}}[arch]
    return make_tiny_model(path, arch, seed=seed, layers=layers, sliding_window=WINDOW, **extra)


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    root = tmp_path_factory.mktemp("sliding")
    return {"target": load_decoder(_sliding(root / "t", "gemma2", seed=10)),
            "draft": load_decoder(_sliding(root / "d", "gemma2", seed=11, layers=2)),
            "target_dir": root / "t", "mistral_dir": _mistral(root / "m", seed=3),
            "mistral_draft_dir": _mistral(root / "md", seed=4, layers=1)}


@pytest.mark.parametrize("arch, windows", [
    ("mistral", (24,) * 4),
    ("phi3", (24,) * 4),
    ("qwen2", (None, None, 24, 24)),
    ("qwen3", (None, None, 24, 24)),
    ("gemma2", (24, None, 24, None)),
    ("olmo3", (24, 24, 24, None)),
    ("starcoder2", (24,) * 4),
])
def test_sliding_layers_decode_as_transformers_past_the_window(tmp_path, arch, windows):
    """80 tokens over a 24-token window: a prefill of 30 then one token at a time, and the same
    as a prefill in chunks of 7, within 1e-4 of transformers' logits (its sliding masks); with
    the windows taken away the engine's full attention differs (why they are applied)."""
    path = _sliding(tmp_path / arch, arch)
    decoder = load_decoder(path)
    assert decoder.spec.layer_windows == windows and decoder.spec.max_position == 512  # nothing capped
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (80,))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids[None]).logits[0]

    def relative(out):
        return float((out - ref).abs().max() / ref.abs().max())

    cache = decoder.new_cache(84)
    stepped = [decoder(ids[:30], torch.arange(30), cache)]
    stepped += [decoder(ids[i : i + 1], torch.tensor([i]), cache) for i in range(30, 80)]
    assert relative(torch.cat(stepped)) <= 1e-4
    cache = decoder.new_cache(84)
    assert relative(torch.cat([decoder(ids[lo : lo + 7], torch.arange(lo, min(lo + 7, 80)), cache)
                               for lo in range(0, 80, 7)])) <= 1e-4
    for layer in decoder.layers:
        layer.self_attn.window = None
    object.__setattr__(decoder.spec, "layer_windows", ())
    assert relative(decoder(ids, torch.arange(80), decoder.new_cache(80))) > 0.01


def test_layer_windows_read_from_each_config_shape():
    assert layer_windows(tiny_config("llama")) == (None,) * 4
    assert layer_windows(tiny_config("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=4)) == (None,) * 4
    assert layer_windows(tiny_config("phi3", sliding_window=None)) == (None,) * 4
    assert ModelSpec.from_hf(tiny_config("gemma2", sliding_window=64)).window == 64
    with pytest.raises(UnsupportedArchitecture, match=r"layer types \['chunked_attention', 'full_attention'\]"):
        layer_windows(tiny_config("gemma2", sliding_window=64, layer_types=["full_attention", "chunked_attention"] * 2))


def test_a_cut_is_the_window_s_keys_a_view_for_a_decode_step_and_a_mask_for_several_rows():
    assert window_cut(torch.tensor([23]), 24, None, WINDOW) is None  # the first 24 positions: all visible
    step = window_cut(torch.tensor([40]), 41, None, WINDOW)
    assert step.start == 17 and step.mask is None  # positions 17..40: the last 24
    chain = window_cut(torch.arange(40, 43), 43, None, WINDOW)
    assert chain.start == 17 and chain.mask.shape == (3, 26)
    assert chain.mask.sum(1).tolist() == [24, 24, 24]
    assert torch.equal(chain.mask[2], torch.tensor([False] * 2 + [True] * 24))
    # a tree of 3 nodes over a 40-token prefix: root (depth 0) and two children, siblings hidden
    tree = torch.cat((torch.ones(3, 40, dtype=torch.bool), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]]).bool()), 1)
    cut = window_cut(torch.tensor([40, 41, 41]), 43, tree, WINDOW)
    assert cut.start == 17 and cut.mask[0, :1].tolist() == [True] and cut.mask[1, 0].item() is False
    assert cut.mask[1].sum().item() == 24 and cut.mask[2, -2].item() is False  # a sibling stays hidden
    full = causal_mask(3, 43).numpy().copy()
    window_rows(full, torch.arange(40, 43).numpy(), WINDOW)
    assert full[:, 17:].tolist() == chain.mask.tolist() and not full[:, :17].any()


def test_a_chunk_cut_sees_its_own_chunk_by_the_keys_positions():
    """Llama 4's chunks (16 here): a row at position p sees keys at p // 16 * 16 .. p. A decode
    step at 40 reads slots 32.. (a view). A tree over 30 committed tokens: x1, x2 at 30 (slots 30,
    31), y (x2's child) at 31 in slot 32, z (y's child) at 32 — a new chunk — in slot 33: z sees
    itself only, not y, whose slot lies in z's chunk but whose position does not (a cut by slots
    would show it); y sees the committed 16..29, x2 and itself. The static step's rows (over the
    whole buffer, their write slots given) get the same."""
    assert window_cut(torch.tensor([15]), 16, None, 16, chunked=True) is None  # the first chunk: all visible
    step = window_cut(torch.tensor([40]), 41, None, 16, chunked=True)
    assert step.start == 32 and step.mask is None
    tree = torch.cat((torch.ones(4, 30, dtype=torch.bool),
                      torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]).bool()), 1)
    positions = torch.tensor([30, 30, 31, 32])  # x1, x2, y, z
    cut = window_cut(positions, 34, tree, 16, chunked=True)
    assert cut.start == 16
    visible = [(row.nonzero().flatten() + 16).tolist() for row in cut.mask]
    assert visible == [list(range(16, 31)), [*range(16, 30), 31], [*range(16, 30), 31, 32], [33]]
    full = np.zeros((4, 48), dtype=bool)
    full[:, :34] = tree.numpy()
    window_rows(full, positions.numpy(), 16, chunked=True, written=np.arange(30, 34))
    assert [row.nonzero()[0].tolist() for row in full] == visible


def _modes(draft):
    return {"chain": ModelChainDrafter(draft, 4), "tree": ModelTreeDrafter(draft, 3, 2, 3), "ngram": NgramDrafter(4)}


def test_every_mode_past_the_window_equals_the_target_alone(sliding):
    """Prompts shorter and longer than the window, 40 new tokens: every verification past it."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in (list(range(5, 15)), [7, 8, 9, 10] * 8):
        reference, _, _ = generate(sliding["target"], prompt, params)
        for mode, drafter in _modes(sliding["draft"]).items():
            assert generate(sliding["target"], prompt, params, drafter)[0] == reference, f"{mode} diverged on {prompt}"


def test_static_steps_past_the_window_equal_the_eager_path(sliding):
    """engine.static's padded steps with the window's mask (a Mistral: the fused pieces; a
    Gemma 2: its modules)."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    mistral = load_decoder(sliding["mistral_dir"])
    static_mistral = fuse_projections(load_decoder(sliding["mistral_dir"])).use_static_steps()
    assert static_mistral.static.pieces is not None
    static_gemma = fuse_projections(load_decoder(sliding["target_dir"])).use_static_steps()
    draft = load_decoder(sliding["mistral_draft_dir"])
    for prompt in (list(range(5, 15)), [7, 8, 9, 10] * 8):
        reference = generate(mistral, prompt, params)[0]
        assert generate(static_mistral, prompt, params)[0] == reference
        assert generate(static_mistral, prompt, params, ModelTreeDrafter(draft, 3, 2, 3))[0] == reference
        gemma_reference = generate(sliding["target"], prompt, params)[0]
        assert generate(static_gemma, prompt, params, ModelChainDrafter(sliding["draft"], 4))[0] == gemma_reference


def test_bf16_row_exact_speculation_past_the_window_equals_bf16_ar(sliding):
    from specctl.engine import rows

    target = load_decoder(sliding["target_dir"], dtype=torch.bfloat16)
    if not rows.make_row_exact(target, "none"):
        pytest.skip("bf16 matmuls are not row-independent on this CPU: row-exact attention stays off here")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in ([7, 8, 9, 10] * 8, list(range(30, 50))):
        reference, _, _ = generate(target, prompt, params)
        for mode, drafter in _modes(sliding["draft"]).items():
            assert generate(target, prompt, params, drafter)[0] == reference, f"bf16 {mode} diverged on {prompt}"


def test_sessions_verified_together_past_the_window_each_equal_the_target_alone(sliding):
    target, draft = sliding["target"], sliding["draft"]
    prompts = [list(range(1, 31)), [9, 8], [40, 41, 42, 43, 44] * 5]
    drafters = [ModelChainDrafter(draft, 4), ModelTreeDrafter(draft, 3, 2, 3), ModelChainDrafter(draft, 4)]
    verified_together_equal_alone(target, prompts, drafters, SamplingParams(max_tokens=30, ignore_eos=True))
