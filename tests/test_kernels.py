import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from specctl_kernels import (causal_mask, eager_attention, flashinfer_available, get_attention, select_backend,
                             static_attention, tree_attention, warm_up)
from specctl_kernels import torch_backend
from specctl_kernels.flashinfer_backend import PackedMasks, pack_mask_bits, rows_per_call


def _naive(q, k, v, mask):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def test_chain_tree_mask_equals_causal_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    # A chain is a tree whose ancestor mask is lower-triangular: prefix of 7, then 5 chained nodes.
    chain = torch.cat([torch.ones(5, 7, dtype=torch.bool), torch.tril(torch.ones(5, 5, dtype=torch.bool))], 1)
    assert torch.equal(chain, causal_mask(5, 12))
    torch.testing.assert_close(tree_attention(q, k, v, chain), tree_attention(q, k, v, None), rtol=0, atol=1e-6)


def test_tree_mask_matches_naive_softmax_attention():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    torch.testing.assert_close(tree_attention(q, k, v, mask), _naive(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_eager_attention_is_sdpa_s_without_scale_or_cap_and_caps_each_score_with_them():
    """Gemma 2's attention (engine.layers picks it where a model scales or caps): with neither,
    the SDPA reference's result for causal, tree and per-row batched masks; with them, the
    naive softmax over cap * tanh(scale * q.k / cap)."""
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    tree = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    for mask in (None, tree, torch.stack((tree, causal_mask(3, 6)))):
        torch.testing.assert_close(eager_attention(q, k, v, mask), tree_attention(q, k, v, mask), rtol=1e-5, atol=1e-6)
    groups = 2
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * 0.3
    capped = (torch.tanh(scores / 2.0) * 2.0).masked_fill(~tree, float("-inf"))
    expected = capped.softmax(-1) @ v.repeat_interleave(groups, 1)
    torch.testing.assert_close(eager_attention(q, k, v, tree, scale=0.3, softcap=2.0), expected, rtol=1e-5, atol=1e-6)
    assert get_attention("torch", 0.3, 2.0).keywords == {"scale": 0.3, "softcap": 2.0, "sinks": None}
    assert get_attention("torch") is torch_backend.tree_attention  # Llama's: SDPA, no partial
    with pytest.raises(ValueError, match="backend 'flashinfer' takes no score scale, cap or sinks: use 'torch'"):
        get_attention("flashinfer", None, 50.0)
    # the static step's attention applies the same scale and cap
    grouped_mask = tree.repeat(groups, 1)
    torch.testing.assert_close(static_attention(q[:1], k[:1], v[:1], grouped_mask, scale=0.3, softcap=2.0),
                               expected[:1], rtol=1e-5, atol=1e-6)


def test_sinks_join_each_row_s_softmax_as_a_column_per_query_head_then_are_dropped():
    """gpt-oss's attention sinks: a logit per query head, one more column in each row's softmax,
    dropped after it (the weights of a row sum to less than 1). Eager (per-session) and static
    attention give the naive softmax's result, query head h taking sink h under grouped KV heads;
    sinks of -inf give plain attention back."""
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    tree = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 8**-0.5).masked_fill(~tree, float("-inf"))
    combined = torch.cat((scores, sinks.reshape(1, 4, 1, 1).expand(2, 4, 3, 1)), dim=-1)
    expected = combined.softmax(-1)[..., :-1] @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(eager_attention(q, k, v, tree, sinks=sinks), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(static_attention(q[:1], k[:1], v[:1], tree.repeat(2, 1), sinks=sinks), expected[:1],
                               rtol=1e-5, atol=1e-6)
    assert not torch.allclose(eager_attention(q, k, v, tree), expected, atol=1e-3)
    torch.testing.assert_close(eager_attention(q, k, v, tree, sinks=torch.full((4,), float("-inf"))),
                               tree_attention(q, k, v, tree), rtol=1e-5, atol=1e-6)
    assert select_backend("auto", "cpu", torch.bfloat16, 64, sinks=True) == "torch"
    with pytest.raises(ValueError, match="takes no score scale, cap or sinks"):
        get_attention("flashinfer", sinks=sinks)


def test_backend_selection_on_cpu():
    assert select_backend("auto", "cpu") == "torch"
    assert select_backend("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("flashinfer", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend 'triton'"):
        select_backend("triton", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not flashinfer_available(), reason="flashinfer not installed")
def test_flashinfer_matches_torch_reference():
    """Keys and values as the KV cache hands them over: views of a longer buffer (flashinfer
    reads them in place, "HND" with strides); a batch of two with a mask each, and causal."""
    torch.manual_seed(2)
    dev = "cuda"
    q = torch.randn(2, 4, 5, 64, device=dev, dtype=torch.float16)
    buffer = torch.randn(2, 2, 2, 32, 64, device=dev, dtype=torch.float16)  # [K/V, B, Hkv, slots, D]
    k, v = buffer[0, :, :, :12], buffer[1, :, :, :12]
    assert not k.is_contiguous()
    mask = causal_mask(5, 12, dev)
    mask[3, 9] = False  # a branch that does not see a sibling
    masks = torch.stack([mask, causal_mask(5, 12, dev)])
    for m in (mask, masks, None):
        ref = tree_attention(q, k, v, m, backend="torch")
        torch.testing.assert_close(tree_attention(q, k, v, m, backend="flashinfer"), ref, rtol=2e-3, atol=2e-3)


def test_auto_backend_falls_back_to_torch_where_flashinfer_has_no_kernels(monkeypatch, caplog):
    import logging

    import specctl_kernels

    monkeypatch.setattr(specctl_kernels, "flashinfer_available", lambda: True)
    with caplog.at_level(logging.INFO, logger="specctl.kernels"):
        assert select_backend("auto", "cuda", torch.float32, 128) == "torch"
    assert "flashinfer has no kernels for float32" in caplog.text
    assert select_backend("auto", "cuda", torch.bfloat16, 96) == "torch"
    assert select_backend("auto", "cuda", torch.bfloat16, 128) == "flashinfer"
    assert select_backend("auto", "cuda", torch.float16, 64) == "flashinfer"
    assert select_backend("auto", "cpu", torch.bfloat16, 128) == "torch"
    assert select_backend("auto", "cuda", torch.bfloat16, 256, softcap=50.0) == "torch"  # Gemma 2: no cap passed it
    with pytest.raises(ValueError, match=r"no kernels for soft-capped attention scores \(Gemma 2"):
        select_backend("flashinfer", "cuda", torch.bfloat16, 256, softcap=50.0)
    with pytest.raises(ValueError, match="'flashinfer' has no kernels for float32 .* use attention_backend = 'auto'"):
        select_backend("flashinfer", "cuda", torch.float32, 128)


def test_static_attention_equals_masked_softmax_attention():
    from specctl_kernels import static_attention

    torch.manual_seed(3)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    mask = torch.zeros(3, 16, dtype=torch.bool)
    mask[:, :6] = True
    mask[1, 6] = mask[2, 7] = True
    grouped = mask.repeat(2, 1)  # 2 query heads per KV head
    torch.testing.assert_close(static_attention(q, k, v, grouped), _naive(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_static_attention_in_bf16_keeps_the_dtype_and_stays_within_bf16_rounding():
    from specctl_kernels import static_attention

    torch.manual_seed(4)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    mask = torch.zeros(3, 16, dtype=torch.bool)
    mask[:, :9] = True
    out = static_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask.repeat(2, 1))
    assert out.dtype == torch.bfloat16 and out.shape == (1, 4, 3, 8)
    torch.testing.assert_close(out.float(), _naive(q, k, v, mask), rtol=0, atol=5e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_half_precision_row_on_the_cpu_is_float32_attention_over_its_keys(dtype):
    """A decode step's attention in bf16/fp16 on the CPU (float32 matmuls, not CPU SDPA's slow
    one-row kernel): grouped-query heads map to their KV head as SDPA's enable_gqa does, and
    the result is float32 attention of the same inputs, rounded once."""
    torch.manual_seed(7)
    q, k, v = torch.randn(1, 12, 1, 64, dtype=dtype), torch.randn(1, 2, 37, 64, dtype=dtype), torch.randn(1, 2, 37, 64, dtype=dtype)
    out = tree_attention(q, k, v, None)
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    assert out.dtype == dtype and out.shape == (1, 12, 1, 64)
    torch.testing.assert_close(out, reference.to(dtype), rtol=0, atol=float(torch.finfo(dtype).eps) * 4)
    # the view of a larger buffer (the cache) and a contiguous copy give the same bits
    buffer = torch.cat([k, torch.randn(1, 2, 11, 64, dtype=dtype)], 2)
    assert torch.equal(tree_attention(q, buffer[:, :, :37], v, None), out)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_packed_mask_bits_are_numpys_little_endian_packbits(rows, cols, seed):
    """flashinfer's packed custom mask, computed with torch so it runs on any device."""
    mask = torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed)) < 0.5
    expected = np.packbits(mask.numpy().reshape(-1), bitorder="little")
    assert pack_mask_bits(mask).tolist() == expected.tolist()


def test_a_forwards_mask_is_packed_once_for_all_its_layers():
    packed = PackedMasks()
    tree = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    batched = torch.stack([tree, tree.flip(1)])
    for _layer in range(4):  # every layer of one forward passes the same tensors
        first = packed.rows(tree, 0, 2, 4, tree.device)[0]
    assert packed.packs == 1 and first.tolist() == pack_mask_bits(tree).tolist()
    for _layer in range(3):
        rows = [packed.rows(batched, b, 2, 4, tree.device)[0] for b in range(2)]
    assert packed.packs == 3 and rows[1].tolist() == pack_mask_bits(batched[1]).tolist()
    for _layer in range(3):  # causal forwards are known by their shape
        causal = packed.rows(None, 0, 3, 7, tree.device)[0]
    assert packed.packs == 4 and causal.tolist() == pack_mask_bits(causal_mask(3, 7)).tolist()
    assert packed.rows(None, 0, 3, 8, tree.device)[0].tolist() == pack_mask_bits(causal_mask(3, 8)).tolist()
    assert packed.packs == 5
    packed.rows(tree, 0, 2, 4, tree.device)[0]
    tree[0, 3] = True  # the same tensor written in place: packed anew
    assert packed.rows(tree, 0, 2, 4, tree.device)[0].tolist() == pack_mask_bits(tree).tolist()
    assert packed.packs == 7
    with torch.inference_mode():  # the engine's masks are inference tensors (no version counter)
        fresh = torch.ones(2, 4, dtype=torch.bool)
        assert packed.rows(fresh, 0, 2, 4, fresh.device)[0].tolist() == pack_mask_bits(fresh).tolist()
    pieces = packed.rows(None, 0, 5, 9, tree.device, step=2)  # one piece a kernel call, rows 2 + 2 + 1
    assert [p.tolist() for p in pieces] == [pack_mask_bits(causal_mask(5, 9)[lo : lo + 2]).tolist() for lo in (0, 2, 4)]


def test_a_verification_goes_to_flashinfer_in_calls_of_the_decode_steps_tile():
    """16 packed rows (query rows x GQA group) a call at most, one row where a group alone is
    more; a prefill (over 64 rows) in one call."""
    assert [rows_per_call(n, 2) for n in (1, 5, 8, 10, 64, 65)] == [8, 8, 8, 8, 8, 65]
    assert [rows_per_call(n, 6) for n in (1, 5, 16)] == [2, 2, 2]  # Qwen2.5-1.5B: 12 heads over 2
    assert rows_per_call(3, 16) == 1 and rows_per_call(3, 32) == 1
    with pytest.raises(ValueError, match="rows and the GQA group must be >= 1, got 0 and 2"):
        rows_per_call(0, 2)


def _unpacked(packed: torch.Tensor, rows: int, total: int) -> torch.Tensor:
    bits = np.unpackbits(packed.numpy(), bitorder="little")[: rows * total]
    return torch.from_numpy(bits.astype(bool)).reshape(rows, total)


def test_flashinfer_tree_attention_cuts_a_verification_into_pieces_with_their_rows_of_the_mask(monkeypatch):
    """A stand-in for flashinfer's single prefill (SDPA over the unpacked mask) records each
    call's rows: a 10-node tree with 4 heads over 2 (group 2) goes as 8 + 2 rows, the rows'
    results land where they belong, and a 70-row prefill is one call."""
    import sys
    import types

    calls = []

    def single_prefill_with_kv_cache(q, k, v, kv_layout, packed_custom_mask):
        assert kv_layout == "HND"
        rows, total = q.shape[0], k.shape[1]
        calls.append(rows)
        mask = _unpacked(packed_custom_mask, rows, total)
        return _naive(q.transpose(0, 1)[None], k[None], v[None], mask)[0].transpose(0, 1)

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        single_prefill_with_kv_cache=single_prefill_with_kv_cache))
    from specctl_kernels import flashinfer_backend

    torch.manual_seed(9)
    q, k, v = torch.randn(2, 4, 10, 16), torch.randn(2, 2, 30, 16), torch.randn(2, 2, 30, 16)
    tree = torch.rand(2, 10, 30) < 0.6
    tree[:, :, :20] = True
    tree[:, torch.arange(10), 20 + torch.arange(10)] = True
    out = flashinfer_backend.tree_attention(q, k, v, tree)
    assert calls == [8, 2, 8, 2]
    for b in range(2):
        torch.testing.assert_close(out[b : b + 1], _naive(q[b : b + 1], k[b : b + 1], v[b : b + 1], tree[b]))
    calls.clear()
    q, k, v = torch.randn(1, 4, 70, 16), torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)
    out = flashinfer_backend.tree_attention(q, k, v, None)
    assert calls == [70]
    torch.testing.assert_close(out, _naive(q, k, v, causal_mask(70, 70)))


def test_only_flashinfer_is_warmed_up():
    assert not warm_up("torch", torch.float32, 4, 2, 16, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not flashinfer_available(), reason="flashinfer not installed")
def test_flashinfer_warm_up_runs_at_a_models_shapes_and_leaves_attention_exact():
    assert warm_up("flashinfer", torch.bfloat16, 4, 2, 64, "cuda")
    q = torch.randn(1, 4, 3, 64, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 9, 64, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(tree_attention(q, kv, kv, None, backend="flashinfer"),
                               tree_attention(q, kv, kv, None, backend="torch"), rtol=2e-2, atol=2e-2)


def test_a_model_on_flashinfer_is_warmed_up_at_load_with_a_status_line(monkeypatch, tiny):
    """The wiring from loading to the warm-up (flashinfer itself needs CUDA: its run is the GPU
    test above); a model on another backend is not warmed up."""
    import io

    from rich.console import Console

    from specctl.spec import factory

    calls = []
    monkeypatch.setattr(factory, "warm_up", lambda *args: calls.append(args) or True)
    decoder = tiny["llama"]
    console = Console(file=io.StringIO())
    factory.warm_up_attention(decoder, console)
    assert calls == []
    monkeypatch.setattr(decoder, "attention_backend", "flashinfer")
    factory.warm_up_attention(decoder, console)
    spec = decoder.spec
    assert calls == [("flashinfer", decoder.dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim, decoder.device)]


def test_a_model_on_flashinfer_gets_an_arena_of_the_kv_budget_and_its_batch_kernels_warmed_up(monkeypatch, tiny_dir):
    """The wiring (flashinfer's batch call itself is a GPU test): the arena of ``kv_budget_mb``
    with paged flashinfer attention, once; the paged warm-up after the single-prefill one."""
    import io

    from rich.console import Console

    from specctl.config import Config
    from specctl.engine.loader import load_decoder
    from specctl.engine.model import Decoder
    from specctl.spec import factory

    decoder = load_decoder(tiny_dir["llama"])
    factory.use_arena_for_flashinfer(decoder, Config(kv_budget_mb=1))
    assert decoder.kv_arena is None  # torch attention: caches of their own
    arenas = []
    real = Decoder.use_kv_arena
    monkeypatch.setattr(Decoder, "use_kv_arena",
                        lambda self, budget, attention: arenas.append((budget, attention)) or real(self, budget, "torch"))
    monkeypatch.setattr(decoder, "attention_backend", "flashinfer")
    factory.use_arena_for_flashinfer(decoder, Config(kv_budget_mb=1))
    factory.use_arena_for_flashinfer(decoder, Config(kv_budget_mb=1))
    assert arenas == [(1 << 20, "flashinfer")] and decoder.kv_arena is not None
    warmed = []
    monkeypatch.setattr(factory, "warm_up", lambda *args: warmed.append("single") or True)
    monkeypatch.setattr(decoder.paged, "warm_up", lambda heads: warmed.append(("paged", heads)))
    factory.warm_up_attention(decoder, Console(file=io.StringIO()))
    assert warmed == ["single", ("paged", decoder.spec.num_heads)]


def test_the_paged_warm_up_reads_the_arena_and_counts_no_forward(tiny_dir):
    from specctl.engine.loader import load_decoder

    decoder = load_decoder(tiny_dir["llama"]).use_kv_arena(1 << 20, attention="torch")
    before = decoder.kv_arena.buffer.clone()
    decoder.paged.warm_up(decoder.spec.num_heads)
    assert decoder.paged.plans == 0 and torch.equal(decoder.kv_arena.buffer, before)
