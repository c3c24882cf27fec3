"""The shared KV arena (engine/kv_arena.py), caches as ranges of it, and batched paged attention
over it (specctl_kernels/paged.py) with the torch reference backend: the page table flashinfer
gets on a GPU, checked here against per-session attention and plain decoding."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specctl.engine.kv_arena import PAGE, KVArena
from specctl.engine.kv_cache import KVCache, KVPool
from specctl.engine.loader import load_decoder
from specctl.errors import KVBudgetExceeded
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate
from specctl_kernels import causal_mask, tree_attention
from specctl_kernels.paged import PagedAttention, paged_reference, plan_pages


def _arena(slots=128, layers=2, kv_heads=2, dim=4):
    return KVArena(layers, kv_heads, dim, slots, torch.float32)


def test_ranges_are_taken_first_fit_and_merged_when_given_back():
    arena = _arena(128)
    a, b, c = arena.allocate(32), arena.allocate(16), arena.allocate(48)
    assert (a, b, c) == (0, 32, 48) and arena.free_slots == 32
    arena.free(b, 16)
    assert arena.allocate(16) == 32  # the hole is reused
    arena.free(32, 16)
    arena.free(a, 32)  # merges with the hole after it
    assert arena.allocate(48) == 0 and arena.free_slots == 32
    arena.free(0, 48)
    arena.free(c, 48)
    assert arena.free_slots == 128 and arena.allocate(128) == 0


def test_bad_ranges_and_a_full_arena_are_refused_with_what_to_do():
    arena = _arena(64)
    with pytest.raises(ValueError, match="positive multiples of 16 slots, not 20"):
        arena.allocate(20)
    with pytest.raises(ValueError, match="a positive multiple of 16 slots, not 40"):
        _arena(40)
    first = arena.allocate(16)
    arena.allocate(16)
    arena.free(first, 16)
    with pytest.raises(ValueError, match="slots 0..16 of the arena are already free"):
        arena.free(first, 16)
    with pytest.raises(KVBudgetExceeded) as full:
        arena.allocate(48)
    assert str(full.value) == ("KV arena full: a session needs 48 contiguous positions and 48 of 64 are free but not "
                               "in one range; retry later, lower max_tokens, or raise kv_budget_mb")
    with pytest.raises(KVBudgetExceeded, match="needs 64 contiguous positions and 48 of 64 are free; retry"):
        arena.allocate(64)


def test_a_full_arena_asks_its_reclaimers_before_refusing():
    arena = _arena(32)
    held = [arena.allocate(32)]
    calls = []

    def give_back() -> bool:
        calls.append(len(held))
        if not held:
            return False
        arena.free(held.pop(), 32)
        return True

    arena.reclaimers.append(give_back)
    assert arena.allocate(16) == 0 and calls == [1]
    with pytest.raises(KVBudgetExceeded):
        arena.allocate(32)
    assert calls == [1, 0]


def test_the_budget_sizes_the_arena():
    arena = KVArena.for_budget(2, 2, 4, 10_000, torch.float32)  # 128 bytes a slot: 78 slots -> 64
    assert arena.slots == 64 and arena.slot_bytes == 128 and arena.buffer.shape == (2, 2, 2, 64, 4)
    with pytest.raises(ValueError, match="holds fewer than 16 positions of this model \\(128 bytes each\\); raise"):
        KVArena.for_budget(2, 2, 4, 1000, torch.float32)


def test_pages_are_views_of_the_buffer():
    arena = _arena(64)
    arena.buffer.copy_(torch.randn_like(arena.buffer))
    keys, values = arena.pages(1)
    assert keys.shape == (4, 2, PAGE, 4) and keys.data_ptr() == arena.buffer[1, 0].data_ptr()
    assert keys.stride() == values.stride()
    assert torch.equal(keys[2, 1, 5], arena.buffer[1, 0, 1, 2 * PAGE + 5])
    assert torch.equal(values[3, 0, 15], arena.buffer[1, 1, 0, 63])


def test_a_cache_on_the_arena_is_a_range_of_it_and_gives_it_back():
    arena, pool = _arena(128), KVPool(None)
    cache = KVCache(2, 2, 4, 20, torch.float32, pool=pool, arena=arena)
    assert cache.slots == 32 and cache.start == 0 and arena.free_slots == 96
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    cache.write(1, k, v)
    assert torch.equal(arena.buffer[1, 0, :, 0:3], k[0]) and torch.equal(arena.buffer[1, 1, :, 0:3], v[0])
    other = KVCache(2, 2, 4, 20, torch.float32, arena=arena)
    assert other.start == 32
    cache.release()
    assert arena.free_slots == 96 and pool.used_bytes == 0 and cache.arena is None
    other.release()
    assert arena.free_slots == 128


def test_a_refused_session_holds_neither_budget_nor_range():
    arena = _arena(32)
    pool = KVPool(None)
    KVCache(2, 2, 4, 20, torch.float32, arena=arena)  # dropped at once: __del__ gives the range back
    assert arena.free_slots == 32
    holder = KVCache(2, 2, 4, 20, torch.float32, arena=arena)
    with pytest.raises(KVBudgetExceeded, match="KV arena full"):
        KVCache(2, 2, 4, 10, torch.float32, pool=pool, arena=arena)
    assert pool.used_bytes == 0 and pool.sessions == 0
    small = KVPool(100)
    holder.release()
    with pytest.raises(KVBudgetExceeded, match="KV cache budget exhausted"):
        KVCache(2, 2, 4, 10, torch.float32, pool=small, arena=arena)
    assert arena.free_slots == 32


def test_a_thousand_sessions_leave_the_arena_as_they_found_it():
    arena = _arena(256)
    for i in range(1000):
        caches = [KVCache(2, 2, 4, 10 + (i + j) % 40, torch.float32, arena=arena) for j in range(3)]
        for cache in caches[::-1] if i % 2 else caches:
            cache.release()
    assert arena.free_slots == 256 and arena.allocate(256) == 0


def test_the_page_table_of_a_forward():
    masks = [None, torch.ones(2, 33, dtype=torch.bool)]
    plan = plan_pages([32, 96], [5, 33], [1, 2], masks, PAGE)
    assert plan.qo_indptr.tolist() == [0, 1, 3] and plan.kv_indptr.tolist() == [0, 1, 4]
    assert plan.kv_indices.tolist() == [2, 6, 7, 8] and plan.last_page_len.tolist() == [5, 1]
    assert plan.qo_indptr.dtype == plan.kv_indices.dtype == torch.int32
    flat = plan.flat_mask("cpu")
    assert flat.shape == (5 + 66,) and torch.equal(flat[:5], causal_mask(1, 5).reshape(-1)) and flat[5:].all()
    with pytest.raises(ValueError, match="must begin on a page"):
        plan_pages([8], [5], [1], [None], PAGE)
    with pytest.raises(ValueError, match="1 <= new tokens <= keys"):
        plan_pages([0], [2], [3], [None], PAGE)
    with pytest.raises(ValueError, match="a mask of shape \\(2, 4\\) for 2 queries over 5 keys"):
        plan_pages([0], [5], [2], [torch.ones(2, 4, dtype=torch.bool)], PAGE)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6), st.booleans()), min_size=1, max_size=4),
       st.integers(0, 2**16), st.none() | st.integers(1, 4))
def test_paged_attention_equals_each_sessions_own_attention(sessions, seed, rows_per_request):
    """Sessions at scattered ranges of one arena, each its cached length, new tokens and mask
    (causal or a random tree-like one): the page table reads exactly each session's keys, also
    with each session's rows cut into requests of a few rows."""
    gen = torch.Generator().manual_seed(seed)
    arena = KVArena(1, 2, 8, 512, torch.float32)
    arena.buffer.copy_(torch.randn(arena.buffer.shape, generator=gen))
    starts, kv_lens, new, masks = [], [], [], []
    for i, (cached, n, tree) in enumerate(sessions):
        starts.append(i * 96 + (16 if i % 2 else 0))
        kv_lens.append(cached + n)
        new.append(n)
        mask = None
        if tree:
            mask = torch.rand(n, cached + n, generator=gen) < 0.6
            mask[:, :cached] = True
            mask[torch.arange(n), cached + torch.arange(n)] = True  # a node sees itself
        masks.append(mask)
    q = torch.randn(sum(new), 4, 8, generator=gen)
    steps = None if rows_per_request is None else [rows_per_request] * len(new)
    out = paged_reference(q, *arena.pages(0), plan_pages(starts, kv_lens, new, masks, PAGE, steps))
    row = 0
    for start, kv_len, n, mask in zip(starts, kv_lens, new, masks):
        k = arena.buffer[0, 0, :, start : start + kv_len][None]
        v = arena.buffer[0, 1, :, start : start + kv_len][None]
        expected = tree_attention(q[row : row + n].transpose(0, 1)[None], k, v, mask)[0].transpose(0, 1)
        torch.testing.assert_close(out[row : row + n], expected, rtol=1e-5, atol=1e-6)
        row += n


def test_a_sessions_rows_cut_into_requests_keep_their_pages_and_their_rows_of_the_mask():
    tree = torch.rand(3, 20) < 0.5
    plan = plan_pages([32, 96], [5, 20], [4, 3], [None, tree], PAGE, rows_per_request=[2, 8])
    assert plan.qo_indptr.tolist() == [0, 2, 4, 7] and plan.kv_indptr.tolist() == [0, 1, 2, 4]
    assert plan.kv_indices.tolist() == [2, 2, 6, 7] and plan.last_page_len.tolist() == [5, 5, 4]
    assert plan.kv_lens == (5, 5, 20)
    assert torch.equal(plan.masks[0], causal_mask(4, 5)[:2]) and torch.equal(plan.masks[1], causal_mask(4, 5)[2:])
    assert torch.equal(plan.masks[2], tree)
    assert torch.equal(plan.flat_mask("cpu"), torch.cat([causal_mask(4, 5).reshape(-1), tree.reshape(-1)]))


def test_flashinfer_plans_a_verification_in_requests_of_the_decode_steps_tile(monkeypatch):
    """The page table handed to flashinfer: 16 packed rows a request at most (group 4: 4 rows),
    a prefill's rows in one."""
    import specctl_kernels.flashinfer_backend as fb

    planned = []

    class FakeBatch:
        def __init__(self, device):
            pass

        def plan(self, plan, *shape):
            planned.append(plan)

    monkeypatch.setattr(fb, "BatchPaged", FakeBatch)
    paged = PagedAttention("flashinfer", _arena(256))
    paged.plan([0, 64], [30, 100], [10, 70], [None, None], num_heads=8)  # 2 KV heads: group 4
    assert planned[0].qo_indptr.tolist() == [0, 4, 8, 10, 80]


def test_an_unknown_paged_backend_is_refused():
    with pytest.raises(ValueError, match="unknown paged attention backend 'cuda': one of torch, flashinfer"):
        PagedAttention("cuda", _arena())


@pytest.fixture(scope="module")
def arena_pair(tiny_dir):
    target = load_decoder(tiny_dir["qwen2"]).use_kv_arena(1 << 20, attention="torch")
    draft = load_decoder(tiny_dir["qwen2-draft"]).use_kv_arena(1 << 20, attention="torch")
    return target, draft


# tree and ngram in --runslow (57 s and 22 s on a slow 2-core machine): the default run keeps ar and chain
@pytest.mark.parametrize("mode", ["ar", "chain", pytest.param("tree", marks=pytest.mark.slow), pytest.param("ngram", marks=pytest.mark.slow)])
def test_generation_over_the_arena_equals_plain_caches(tiny, arena_pair, mode):
    target, draft = arena_pair
    drafters = {"ar": lambda d: None, "chain": lambda d: ModelChainDrafter(d, 4),
                "tree": lambda d: ModelTreeDrafter(d, 3, 2, 3), "ngram": lambda d: NgramDrafter(4)}[mode]
    planned = target.paged.plans
    for params in (SamplingParams(max_tokens=30, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, ignore_eos=True, seed=5)):
        for prompt in ([1, 2, 3], list(range(30, 70)), [7, 8, 9, 10] * 6):
            reference = generate(tiny["qwen2"], prompt, params, drafters(tiny["qwen2-draft"]))[0]
            assert generate(target, prompt, params, drafters(draft))[0] == reference, (mode, prompt)
    assert target.paged.plans > planned  # the forwards went through the page table
    assert target.kv_arena.free_slots == target.kv_arena.slots  # every session gave its range back


def test_a_batch_of_sessions_over_the_arena_equals_each_alone(tiny, arena_pair):
    target, _ = arena_pair
    plain = tiny["qwen2"]
    prompts = [list(range(5, 25)), [3, 4, 5], list(range(40, 80))]
    caches = [target.new_cache(128) for _ in prompts]
    alone = [plain.new_cache(128) for _ in prompts]
    for prompt, cache, own in zip(prompts, caches, alone):
        target(torch.tensor(prompt), torch.arange(len(prompt)), cache)
        plain(torch.tensor(prompt), torch.arange(len(prompt)), own)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    new = [torch.tensor([9]), torch.tensor([6, 7, 8]), torch.tensor([1, 2])]
    masks = [None, torch.cat([torch.ones(3, 3, dtype=torch.bool), tree], 1), None]
    positions = [torch.tensor([20]), torch.tensor([3, 4, 4]), torch.tensor([40, 41])]
    plans = target.paged.plans
    batched = target.forward_many(new, positions, caches, masks, [torch.arange(len(t)) for t in new])
    assert target.paged.plans == plans + 1  # one plan for the whole batch, every layer
    for tokens, pos, own, mask, out in zip(new, positions, alone, masks, batched):
        torch.testing.assert_close(out, plain(tokens, pos, own, mask), rtol=1e-5, atol=1e-5)
    for cache in caches + alone:
        cache.release()


def test_static_steps_keep_spare_ranges_and_give_them_back_when_the_arena_is_full(tiny_dir):
    decoder = load_decoder(tiny_dir["qwen2"]).use_static_steps()
    slot_bytes = 2 * decoder.num_layers * decoder.spec.num_kv_heads * decoder.spec.head_dim * 4
    decoder.use_kv_arena(512 * slot_bytes)  # two 256-slot ranges
    arena = decoder.kv_arena
    first = decoder.new_cache(100)
    decoder(torch.tensor([1, 2, 3]), torch.arange(3), first)
    start = first.start
    first.release()
    assert arena.free_slots == 256  # kept, with its steps, for the next session of its size
    again = decoder.new_cache(100)
    assert again.start == start and decoder.static.reused == 1 and again.steps
    other = decoder.new_cache(100)
    again.release()
    other.release()
    assert arena.free_slots == 0  # both kept
    big = decoder.new_cache(400)  # needs the whole arena: the spares go
    assert big.start == 0 and decoder.static.spares.nbytes == 0
    big.release()


def test_replaced_static_steps_give_their_spare_ranges_back_and_leave_the_arena(tiny_dir):
    decoder = load_decoder(tiny_dir["qwen2"]).use_static_steps()
    decoder.use_kv_arena(512 * decoder.kv_slot_bytes)
    arena, old = decoder.kv_arena, decoder.static
    cache = decoder.new_cache(100)
    cache.release()
    assert arena.free_slots == 256 and arena.reclaimers == [old.spares.drop_all]  # a spare range kept
    decoder.use_static_steps(graphs=False)  # e.g. bench kernels' next variant
    assert arena.free_slots == 512 and old.spares.nbytes == 0
    assert arena.reclaimers == [decoder.static.spares.drop_all]  # the old runner is no longer asked (nor kept alive)


def test_cache_operations_on_a_range_equal_those_on_a_buffer_and_stay_inside_it():
    """write, gather (tree pruning), place (a pipeline forward's dead rows), truncate: the same
    keys as a cache with a buffer of its own, and the neighbours' ranges untouched."""
    arena = _arena(128)
    before = KVCache(2, 2, 4, 20, torch.float32, arena=arena)
    ranged = KVCache(2, 2, 4, 20, torch.float32, arena=arena)
    after = KVCache(2, 2, 4, 20, torch.float32, arena=arena)
    arena.buffer[:, :, :, : before.slots] = 1.0
    arena.buffer[:, :, :, after.start :] = 2.0
    own = KVCache(2, 2, 4, 20, torch.float32)
    gen = torch.Generator().manual_seed(3)
    for cache in (ranged, own):
        gen.manual_seed(3)
        for layer in (0, 1):
            cache.write(layer, torch.randn(1, 2, 9, 4, generator=gen), torch.randn(1, 2, 9, 4, generator=gen))
        cache.commit(9)
        cache.gather([0, 1, 2, 5, 7])
        for layer in (0, 1):
            cache.write(layer, torch.randn(1, 2, 2, 4, generator=gen), torch.randn(1, 2, 2, 4, generator=gen))
        cache.commit(2)
        cache.place(5, [0, 2], 4)
        cache.truncate(8)
    assert torch.equal(ranged.kv[:, :, :, :, :8], own.kv[:, :, :, :, :8])
    assert (arena.buffer[:, :, :, : before.slots] == 1.0).all() and (arena.buffer[:, :, :, after.start :] == 2.0).all()
