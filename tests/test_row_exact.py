"""Row-exact attention (specctl_kernels.row_exact): a verification forward of a bf16 or int8
target reproduces AR decoding bit for bit, so speculative output equals the target alone."""

import pytest
import torch

from specctl.config import Config
from specctl.engine.loader import load_decoder
from specctl.engine.quant import quantize_decoder
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.engine import rows
from specctl.engine.rows import (
    PaddedRowLinear, candidate, decoder_row_blocks, linear_rows_independent, make_row_exact, pad_small_products,
)
from specctl.spec.rounds import generate
from specctl.spec.params import SamplingParams
from specctl_kernels import row_exact, tree_attention

HEADS, KV_HEADS, DIM = 6, 2, 16


def _qkv(rows: int, keys: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, HEADS, rows, DIM, generator=gen), torch.randn(1, KV_HEADS, keys, DIM, generator=gen),
            torch.randn(1, KV_HEADS, keys, DIM, generator=gen))


def _tree_mask(parents: list[int], prefix: int) -> torch.Tensor:
    """[n, prefix + n]: each node sees the prefix, its ancestors and itself (parents[0] = -1)."""
    n = len(parents)
    mask = torch.zeros(n, prefix + n, dtype=torch.bool)
    mask[:, :prefix] = True
    for node in range(n):
        ancestor = node
        while ancestor >= 0:
            mask[node, prefix + ancestor] = True
            ancestor = parents[ancestor]
    return mask


def test_each_chain_row_is_the_one_token_call_over_the_keys_before_it():
    q, k, v = _qkv(7, 50)
    mask = _tree_mask([-1, 0, 1, 2, 3, 4, 5], 43)
    out = row_exact(tree_attention)(q, k, v, mask)
    for i in range(7):
        alone = tree_attention(q[:, :, i : i + 1], k[:, :, : 44 + i], v[:, :, : 44 + i], None)
        assert torch.equal(out[:, :, i : i + 1], alone)
    torch.testing.assert_close(out, tree_attention(q, k, v, mask))  # the same attention, to the last bits aside


def test_a_tree_node_attends_to_prefix_ancestors_and_itself_in_cache_order():
    parents = [-1, 0, 0, 1, 2, 2, 4]
    q, k, v = _qkv(7, 20 + 7, seed=1)
    mask = _tree_mask(parents, 20)
    out = row_exact(tree_attention)(q, k, v, mask)
    for node, path in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 2, 5], [0, 2, 4, 6]]):
        index = torch.tensor(list(range(20)) + [20 + p for p in path])
        alone = tree_attention(q[:, :, node : node + 1], k[:, :, index], v[:, :, index], None)
        assert torch.equal(out[:, :, node : node + 1], alone), node


def test_rows_with_gaps_after_different_leading_runs_each_see_exactly_their_keys():
    """Any mask, not only a tree's: rows whose visible keys start with runs of different
    lengths and then skip some, beside rows that see a plain run (a view of the cache)."""
    q, k, v = _qkv(5, 30, seed=3)
    mask = torch.zeros(5, 30, dtype=torch.bool)
    mask[0, :12] = True  # a plain run
    mask[1, :10] = True
    mask[1, [14, 20]] = True
    mask[2, :25] = True
    mask[2, 27] = True
    mask[3, :30] = True  # all
    mask[4, [0, 2, 29]] = True  # a leading run of 1
    out = row_exact(tree_attention)(q, k, v, mask)
    for row in range(5):
        index = mask[row].nonzero().squeeze(1)
        alone = tree_attention(q[:, :, row : row + 1], k[:, :, index], v[:, :, index], None)
        assert torch.equal(out[:, :, row : row + 1], alone), row


def test_unmasked_calls_and_batched_masks():
    q, k, v = _qkv(5, 12, seed=2)
    assert torch.equal(row_exact(tree_attention)(q, k, v, None), tree_attention(q, k, v, None))
    q2, k2, v2 = (torch.cat([t, t.flip(-1)]) for t in (q, k, v))
    masks = torch.stack([_tree_mask([-1, 0, 0, 1, 2], 7), _tree_mask([-1, 0, 1, 2, 3], 7)])
    out = row_exact(tree_attention)(q2, k2, v2, masks)
    for b in range(2):
        assert torch.equal(out[b : b + 1], row_exact(tree_attention)(q2[b : b + 1], k2[b : b + 1], v2[b : b + 1], masks[b]))


@pytest.mark.parametrize("device, dtype, quant, expected", [
    ("cpu", "bf16", "none", True), ("cpu", "fp16", "none", True), ("cpu", "fp32", "int8", True),
    ("cpu", "fp32", "none", False), ("cuda", "bf16", "none", False),
])
def test_row_exact_is_a_candidate_only_where_linear_layers_can_be_row_independent(device, dtype, quant, expected):
    assert candidate(device, dtype, quant) is expected


def test_a_target_no_padding_makes_row_independent_is_said_in_a_warning(tiny_dir, monkeypatch, caplog):
    monkeypatch.setattr(rows, "linear_rows_independent", lambda *args: False)  # as on an AMX Xeon in bf16
    with caplog.at_level("WARNING", logger="specctl.engine"):
        assert decoder_row_blocks(_target(tiny_dir, "bf16"), "none") is None
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert caplog.records[0].getMessage() == (
        "row-exact attention off: torch.bfloat16 matmuls are not row-independent on this CPU, so speculative "
        "output may differ from AR's where its top logits nearly tie")


def test_the_probe_finds_int8_row_independent_and_a_row_mixing_layer_not(tiny_dir):
    assert decoder_row_blocks(_target(tiny_dir, "int8"), "int8") == (1, None)

    class Mixing(torch.nn.Linear):  # each row's output depends on the whole batch
        def forward(self, x):
            return super().forward(x) + x.mean(0, keepdim=True)[..., : self.out_features]

    assert not linear_rows_independent(Mixing(16, 8))
    class Scaling(torch.nn.Linear):  # row by row, elementwise
        def forward(self, x):
            return 2 * x[..., : self.out_features]

    assert linear_rows_independent(Scaling(16, 8))


def test_the_switch_is_a_validated_config_field():
    assert Config().row_exact_attention is True
    with pytest.raises(Exception, match="row_exact_attention must be true or false, got 'yes'"):
        Config(row_exact_attention="yes")


def _target(tiny_dir, kind: str, arch: str = "llama"):
    if kind == "bf16":
        return load_decoder(tiny_dir[arch], dtype=torch.bfloat16)
    return quantize_decoder(load_decoder(tiny_dir[arch]), "int8")


def _row_exact_target(tiny_dir, kind: str, arch: str = "llama"):
    """The target as load_named(target=True) makes it; bf16 exactness needs this CPU's bf16
    matmuls to be row-independent, alone or with small products padded and large ones
    blocked (the load-time probe), int8 has it by construction."""
    target = _target(tiny_dir, kind, arch)
    if not make_row_exact(target, "int8" if kind == "int8" else "none"):
        pytest.skip(f"{kind} matmuls are not row-independent on this CPU: row-exact attention stays off here")
    return target


class OneRowOff(torch.nn.Linear):
    """A layer whose one-row products take another kernel (a CPU's matrix-vector path), 1e-3 off."""

    def forward(self, x):
        return super().forward(x) + (1e-3 if x.numel() == x.shape[-1] else 0.0)


def test_the_probe_tells_a_layer_exact_in_pairs_from_one_exact_alone():
    layer = OneRowOff(16, 8)
    assert not linear_rows_independent(layer) and linear_rows_independent(layer, min_rows=2)

    class Mixing(torch.nn.Linear):  # each row's output depends on the other rows: not even in pairs
        def forward(self, x):
            return super().forward(x) + x.mean(0, keepdim=True)[..., : self.out_features]

    assert not any(linear_rows_independent(Mixing(16, 8), n) for n in rows.PAD_CANDIDATES)


def test_the_probe_finds_the_row_count_from_which_every_product_agrees():
    class SmallProductsOff(torch.nn.Linear):  # one and two rows take another kernel (this CPU's bf16)
        def forward(self, x):
            return super().forward(x) + (1e-3 if x.numel() <= 2 * x.shape[-1] else 0.0)

    layer = SmallProductsOff(16, 8)
    assert [linear_rows_independent(layer, n) for n in (1, 2, 3, 4)] == [False, False, True, True]


def test_the_probe_sees_a_tail_block_that_differs():
    """Rows 4.. of a product whose row count is no multiple of 4 off (a kernel's tail block):
    every row of 8 rows agrees with the row alone, row 4 of 6 rows does not, and no padding
    mends it (13 rows has such a tail too)."""
    class TailOff(torch.nn.Linear):
        def forward(self, x):
            out = super().forward(x)
            if x.shape[0] % 4 and x.shape[0] > 4:
                out = out.clone()
                out[4:] += 1e-3
            return out

    assert not any(linear_rows_independent(TailOff(16, 8), n) for n in rows.PAD_CANDIDATES)


def test_padding_computes_small_products_padded_and_shares_the_weights(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4, bias=False))
    weights = [model[0].weight, model[0].bias, model[1].weight]
    pad_small_products(model, 3)
    assert [type(m) for m in model] == [PaddedRowLinear, PaddedRowLinear] and model[0].min_rows == 3
    assert [model[0].weight, model[0].bias, model[1].weight] == weights and model[1].bias is None
    linear, shapes = torch.nn.functional.linear, []
    monkeypatch.setattr(rows.F, "linear", lambda x, w, b=None: shapes.append(tuple(x.shape)) or linear(x, w, b))
    x = torch.randn(4, 16)
    one = model[0](x[:1].reshape(1, 1, 16))
    assert shapes == [(3, 16)] and one.shape == (1, 1, 8)
    assert torch.equal(one.reshape(8), linear(x[:1].repeat(3, 1), *weights[:2])[0])
    two = model[0](x[:2])
    assert shapes[-1] == (3, 16) and torch.equal(two, linear(x[[0, 1, 1]], *weights[:2])[:2])
    assert torch.equal(model[0](x), linear(x, *weights[:2])) and shapes[-1] == (4, 16)


class LargeProductsOff(torch.nn.Linear):
    """A layer whose products of more than 32 rows take another kernel (an AMX Xeon's bf16), 1e-3 off."""

    def forward(self, x):
        return super().forward(x) + (1e-3 if x.numel() > 32 * x.shape[-1] else 0.0)


def test_the_probe_sees_large_products_that_differ_and_blocks_mend_them():
    layer = LargeProductsOff(16, 8)
    sizes = rows.PREFILL_PROBE_SIZES
    assert not any(linear_rows_independent(layer, n, sizes) for n in rows.PAD_CANDIDATES)
    assert linear_rows_independent(layer, 2, sizes, max_rows=32) and linear_rows_independent(layer, 2, sizes, max_rows=8)
    assert not linear_rows_independent(layer, 2, sizes, max_rows=64)


def test_the_decoder_probe_tries_padding_alone_first_then_the_largest_blocks(tiny_dir, monkeypatch):
    tried = []

    def independent_in_blocks_of_16_from_two_rows(linear, min_rows, sizes, max_rows):
        tried.append((min_rows, max_rows))
        return min_rows >= 2 and max_rows is not None and max_rows <= 16

    monkeypatch.setattr(rows, "linear_rows_independent", independent_in_blocks_of_16_from_two_rows)
    assert decoder_row_blocks(_target(tiny_dir, "bf16"), "none") == (2, 16)
    assert list(dict.fromkeys(tried)) == [(1, None), (2, None), (3, None), (4, None), (8, None), (1, 32), (2, 32),
                                         (3, 32), (4, 32), (8, 32), (1, 16), (2, 16)]


def test_blocked_products_are_computed_in_blocks_the_last_padded(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    weight, bias = model[0].weight, model[0].bias
    pad_small_products(model, 2, 32)
    assert (model[0].min_rows, model[0].max_rows) == (2, 32)
    linear, shapes = torch.nn.functional.linear, []
    monkeypatch.setattr(rows.F, "linear", lambda x, w, b=None: shapes.append(x.shape[0]) or linear(x, w, b))
    x = torch.randn(65, 16)
    out = model[0](x.reshape(5, 13, 16))
    assert shapes == [32, 32, 2] and out.shape == (5, 13, 8)
    blocks = [linear(x[:32], weight, bias), linear(x[32:64], weight, bias), linear(x[[64, 64]], weight, bias)[:1]]
    assert torch.equal(out.reshape(65, 8), torch.cat(blocks))
    shapes.clear()
    assert torch.equal(model[0](x[:32]), linear(x[:32], weight, bias)) and shapes == [32]
    assert torch.equal(model[0](x[:1]), linear(x[[0, 0]], weight, bias)[:1]) and shapes == [32, 2]


def test_a_row_exact_target_keeps_its_decoder_as_it_was_where_no_counts_do(tiny_dir, monkeypatch):
    monkeypatch.setattr(rows, "linear_rows_independent", lambda *args: False)
    target = _target(tiny_dir, "bf16")
    assert make_row_exact(target, "none") is False and not target.row_exact
    assert not any(isinstance(m, PaddedRowLinear) for m in target.modules())


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_verification_logits_equal_ar_step_logits_bit_for_bit(tiny_dir, kind):
    """A chain and a tree (the path's nodes among siblings) verified in one forward give each
    path node exactly the logits AR decoding computes at that position."""
    target = _row_exact_target(tiny_dir, kind)
    prompt, path = [5, 9, 14, 3, 77, 21, 8], [40, 41, 42, 43, 44]
    ar_cache = target.new_cache(64)
    target(torch.tensor(prompt[:-1]), torch.arange(len(prompt) - 1), ar_cache)
    ar_logits = []
    for position, token in enumerate([prompt[-1], *path], start=len(prompt) - 1):
        ar_logits.append(target(torch.tensor([token]), torch.tensor([position]), ar_cache)[0])
    prefix = len(prompt) - 1
    # tree: root, a sibling of 40, 40, a sibling of 41, 41, 42, 43, 44 (a chain is the same minus siblings)
    for tokens, parents, path_nodes in (
        ([prompt[-1], *path], [-1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]),
        ([prompt[-1], 90, 40, 91, 41, 42, 43, 44], [-1, 0, 0, 2, 2, 4, 5, 6], [0, 2, 4, 5, 6, 7]),
    ):
        cache = target.new_cache(64)
        target(torch.tensor(prompt[:-1]), torch.arange(prefix), cache)
        depth = torch.zeros(len(parents), dtype=torch.long)
        for node in range(1, len(parents)):
            depth[node] = depth[parents[node]] + 1
        logits = target(torch.tensor(tokens), prefix + depth, cache, mask=_tree_mask(parents, prefix))
        for step, node in enumerate(path_nodes):
            assert torch.equal(logits[node], ar_logits[step]), f"node {node} (step {step}) differs from AR"
        cache.release()
    ar_cache.release()


@pytest.mark.parametrize("kind, arch", [("bf16", "llama"), ("int8", "llama"), ("bf16", "qwen3"),
                                        ("bf16", "phi3"), ("bf16", "gemma2"), ("bf16", "gemma3"),
                                        ("bf16", "qwen3_moe"), ("int8", "mixtral"), ("bf16", "granite"),
                                        ("int8", "qwen2_moe"), ("bf16", "qwen2_moe"), ("bf16", "olmo2"),
                                        ("bf16", "olmo3"), ("bf16", "starcoder2"), ("int8", "starcoder2"),
                                        ("bf16", "smollm3"), ("bf16", "glm4"), ("bf16", "exaone4"),
                                        ("bf16", "cohere2"), ("bf16", "gpt_oss"), ("int8", "gpt_oss"),
                                        ("bf16", "gpt_neox"), ("bf16", "glm4_moe"), ("int8", "glm4_moe"),
                                        ("bf16", "deepseek_v3"), ("int8", "deepseek_v3"),
                                        ("bf16", "llama4"), ("bf16", "phi")])  # (their int8: test_quant's batched == alone)
def test_speculative_output_equals_the_target_alone_in_bf16_and_int8(tiny_dir, tiny, kind, arch):
    target = _row_exact_target(tiny_dir, kind, arch)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    draft = tiny[f"{arch}-draft"]
    drafters = {"chain": ModelChainDrafter(draft, 4), "tree": ModelTreeDrafter(draft, 3, 2, 3), "ngram": NgramDrafter(4)}
    for prompt in ([7, 8, 9, 10] * 5, list(range(30, 60))):
        reference, _, _ = generate(target, prompt, params)
        for name, drafter in drafters.items():
            assert generate(target, prompt, params, drafter)[0] == reference, f"{kind} {name} diverged on {prompt}"


def test_sessions_verified_together_in_bf16_each_equal_the_target_alone(tiny_dir, tiny):
    """The ragged many-session forward (a target instance's batch) is row-exact too."""
    from tests.conftest import verified_together_equal_alone

    target = _row_exact_target(tiny_dir, "bf16")
    chain, tree = ModelChainDrafter(tiny["llama-draft"], 4), ModelTreeDrafter(tiny["llama-draft"], 3, 2, 3)
    prompts = [[1, 2, 3, 4, 5], [9, 8], [40, 41, 42, 43, 44, 45, 46]]
    verified_together_equal_alone(target, prompts, [chain, tree, chain], SamplingParams(max_tokens=20, ignore_eos=True))


@pytest.mark.parametrize("shared", ["this-cpu", "disagrees"])
@pytest.mark.parametrize("blocks", ["this-cpu", "disagrees"])
@pytest.mark.parametrize("probe", ["this-cpu", "disagrees"])
def test_half_precision_rows_of_one_key_bucket_share_a_call_with_each_row_as_a_decode_step_computes_it(
        monkeypatch, probe, blocks, shared):
    """A bf16 prefill of 130 rows after 20 cached keys (rows in 3 buckets of 64 keys) and a
    chain: each row equals the decoder's one-token call over the keys before it — batched by
    bucket where this CPU's probe agrees (measured on AMD EPYC and AMX Xeon hosts); where it
    does not (as on another EPYC host of 2026-12-05, and as monkeypatched), in calls of
    ROW_BLOCK rows, a decode step's too, where the block probe agrees (as on that host), else a
    call a row; a call a row reads keys made float32 once for all rows where the second probe
    agrees (as on that host)."""
    from specctl_kernels import torch_backend

    shape = (HEADS // KV_HEADS, DIM, DIM, torch.bfloat16)
    agree = probe == "this-cpu" and torch_backend.batched_rows_agree(*shape)
    block = blocks == "this-cpu" and torch_backend.fixed_blocks_agree(*shape)  # probed before the count below
    share = shared == "this-cpu" and torch_backend.shared_floats_agree(*shape)
    calls = []
    original = torch_backend.rows_over_leading_keys
    monkeypatch.setattr(torch_backend, "rows_over_leading_keys",
                        lambda q, k, v, visible, floats=None: calls.append((len(visible), floats is not None))
                        or original(q, k, v, visible, floats))
    if probe == "disagrees":
        monkeypatch.setattr(torch_backend, "batched_rows_agree", lambda *shape: False)
    if blocks == "disagrees":
        monkeypatch.setattr(torch_backend, "fixed_blocks_agree", lambda *shape: False)
    if shared == "disagrees":
        monkeypatch.setattr(torch_backend, "shared_floats_agree", lambda *shape: False)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, HEADS, 130, DIM, generator=gen).bfloat16()
    k, v = (torch.randn(1, KV_HEADS, 150, DIM, generator=gen).bfloat16() for _ in range(2))
    attend = row_exact(tree_attention, prefill=True)
    out = attend(q, k, v, None)
    rows_seen = list(calls)
    calls.clear()
    for i in range(130):
        alone = attend(q[:, :, i : i + 1], k[:, :, : 21 + i], v[:, :, : 21 + i], None)
        assert torch.equal(out[:, :, i : i + 1], alone), i
    in_blocks = block and not agree
    # a decode step is one row of its own bucket (in a block of its own), its keys its own
    assert calls == [(torch_backend.ROW_BLOCK if in_blocks else 1, False)] * 130
    # keys 21..64 | 65..128 | 129..150: one call a bucket, blocks of ROW_BLOCK rows, or one call a row
    assert rows_seen == ([(44, False), (64, False), (22, False)] if agree
                         else [(torch_backend.ROW_BLOCK, True)] * (130 // torch_backend.ROW_BLOCK) if in_blocks
                         else [(1, share)] * 130)


def test_where_the_block_probe_agrees_a_row_gets_its_bits_anywhere_in_a_block_at_lengths_it_did_not_try():
    """The block probe tries five key counts; where it agrees, a row of a block over its bucket's
    keys (its own, or a float32 copy of longer ones) gets the bits it gets alone in a block."""
    from specctl_kernels.torch_backend import ROW_BLOCK, floats_of, fixed_blocks_agree, rows_in_blocks

    if not fixed_blocks_agree(6, 128, 128, torch.bfloat16):
        pytest.skip("this CPU gives a row other bits in a block: row_exact keeps a call a row here")
    gen = torch.Generator().manual_seed(14)
    k, v = (torch.randn(1, 2, 3100, 128, generator=gen).bfloat16() for _ in range(2))
    floats = floats_of(k, v, 3100)
    for last in (7, 65, 513, 1999, 3000):
        counts = [last - (r * 5) % 7 if last > 7 else last for r in range(2 * ROW_BLOCK + 1)]
        q = torch.randn(1, 12, len(counts), 128, generator=gen).bfloat16()
        for keys in (None, floats):
            together = rows_in_blocks(q, k, v, counts, ROW_BLOCK, keys)
            for r, count in enumerate(counts):
                alone = rows_in_blocks(q[:, :, r : r + 1], k[:, :, :count], v[:, :, :count], [count], ROW_BLOCK)
                assert torch.equal(together[:, :, r : r + 1], alone), (last, r)


def test_where_the_shared_floats_probe_agrees_rows_over_keys_made_float32_once_agree_at_lengths_it_did_not_try():
    """The probe tries five key counts; where it agrees, rows over one float32 copy of longer
    keys must get their lone bits at other counts too (a long prefill's rows: 1,000-3,000 keys)."""
    from specctl_kernels.torch_backend import floats_of, rows_over_leading_keys, shared_floats_agree

    if not shared_floats_agree(6, 128, 128, torch.bfloat16):
        pytest.skip("this CPU gives a row over shared float32 keys other bits: each row copies its keys")
    gen = torch.Generator().manual_seed(12)
    k, v = (torch.randn(1, 2, 3100, 128, generator=gen).bfloat16() for _ in range(2))
    floats = floats_of(k, v, 3100)
    for count in (7, 65, 513, 1999, 3000, 3100):
        q = torch.randn(1, 12, 1, 128, generator=gen).bfloat16()
        alone = rows_over_leading_keys(q, k[:, :, :count], v[:, :, :count], [count])
        assert torch.equal(rows_over_leading_keys(q, k, v, [count], floats), alone), count


def test_float_copies_zero_their_padding_though_fresh_memory_holds_nans():
    """floats_of takes uninitialised memory and zeroes only the padding past the keys; with
    torch filling fresh memory with NaN, a row over 70 keys (padded to 128) must still get
    finite bits equal to a float32 reference (a NaN left in the padding makes 0 x NaN)."""
    from specctl_kernels.torch_backend import floats_of, rows_over_leading_keys

    gen = torch.Generator().manual_seed(13)
    q = torch.randn(1, 12, 1, 128, generator=gen).bfloat16()
    k, v = (torch.randn(1, 2, 70, 128, generator=gen).bfloat16() for _ in range(2))
    deterministic = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        assert torch.isnan(torch.empty(4)).all()  # the setting this test relies on
        keys, values = floats_of(k, v, 70)
        out = rows_over_leading_keys(q, k, v, [70])
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    assert keys.shape[2] == values.shape[2] == 128
    assert torch.equal(keys[:, :, 70:], torch.zeros(1, 2, 58, 128)) and torch.equal(values[:, :, 70:], keys[:, :, 70:])
    assert torch.equal(keys[:, :, :70], k.float()) and torch.equal(values[:, :, :70], v.float())
    reference = torch.softmax(q.float().view(2, 6, 128) @ k.float()[0].transpose(-1, -2) * 128**-0.5, -1) @ v.float()[0]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float().view(2, 6, 128), reference, rtol=1e-2, atol=1e-2)


def test_a_tree_nodes_rows_keep_a_call_each_beside_the_batched_chain_rows():
    q, k, v = (t.bfloat16() for t in _qkv(7, 70 + 7, seed=5))
    parents = [-1, 0, 0, 1, 2, 2, 4]
    attend = row_exact(tree_attention)
    out = attend(q, k, v, _tree_mask(parents, 70))
    for node, path in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 2, 5], [0, 2, 4, 6]]):
        index = torch.tensor(list(range(70)) + [70 + p for p in path])
        alone = attend(q[:, :, node : node + 1], k[:, :, index], v[:, :, index], None)  # as the decoder decodes
        assert torch.equal(out[:, :, node : node + 1], alone), node


def test_where_the_batched_rows_probe_agrees_rows_of_counts_it_did_not_try_agree_too():
    """The probe tries four row counts and decides for every count of its shape: where it
    agrees, rows of counts it did not try must get their lone bits together too. (It agreed on
    AMD EPYC and AMX Xeon hosts with torch 2.13; on another EPYC host of 2026-12-05 it does
    not, and row_exact keeps a call a row there: nothing to check.)"""
    from specctl_kernels.torch_backend import ROW_BUCKET, batched_rows_agree, rows_over_leading_keys

    if not batched_rows_agree(6, 128, 128, torch.bfloat16):
        pytest.skip("this CPU gives a row other bits among many rows: row_exact keeps a call a row here")
    gen = torch.Generator().manual_seed(11)
    differs = []
    for count, keys in ((5, 128), (20, 192), (48, 64)):
        q = torch.randn(1, 6, count, 128, generator=gen).bfloat16()
        k, v = (torch.randn(1, 1, keys, 128, generator=gen).bfloat16() for _ in range(2))
        visible = [keys - (r * 29) % ROW_BUCKET for r in range(count)]
        together = rows_over_leading_keys(q, k, v, visible)
        differs += [not torch.equal(together[:, :, r : r + 1], rows_over_leading_keys(q[:, :, r : r + 1], k, v,
                                                                                     [visible[r]]))
                    for r in range(count)]
    assert not any(differs)
