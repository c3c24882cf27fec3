import pytest
import torch

from specctl.engine.kv_cache import KVCache, KVPool
from specctl.errors import KVBudgetExceeded


def _filled(length=6, capacity=10, pool=None):
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, capacity=capacity, dtype=torch.float32, pool=pool)
    values = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1).expand(1, 1, length, 2)
    for layer in range(2):
        cache.write(layer, values, -values)
    cache.commit(length)
    return cache


def _positions(cache, layer=0):
    return cache.k[layer, 0, 0, : cache.length, 0].tolist()


def test_append_then_truncate():
    cache = _filled()
    assert _positions(cache) == [0, 1, 2, 3, 4, 5]
    cache.truncate(4)
    assert cache.length == 4 and _positions(cache) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot truncate a cache of length 4 to 5"):
        cache.truncate(5)


def test_gather_keeps_an_arbitrary_subset_in_order():
    cache = _filled()
    cache.gather([0, 1, 3, 5])
    assert cache.length == 4
    assert _positions(cache, 0) == [0, 1, 3, 5] and _positions(cache, 1) == [0, 1, 3, 5]
    assert cache.v[1, 0, 0, :4, 0].tolist() == [0, -1, -3, -5]
    with pytest.raises(ValueError, match="gather index 7 beyond cache length 4"):
        cache.gather([0, 7])


def test_write_beyond_capacity_is_refused():
    cache = _filled(length=9)
    with pytest.raises(KVBudgetExceeded, match="session KV cache full"):
        cache.write(0, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))


def test_skipped_positions_keep_the_order_and_respect_the_capacity():
    cache = _filled(length=4)
    cache.skip(3)  # a dead pipeline forward's rows: counted, never written
    assert cache.length == 7
    cache.gather([0, 1, 2, 3])  # the pruning that follows drops them
    assert _positions(cache) == [0, 1, 2, 3]
    with pytest.raises(KVBudgetExceeded, match="session KV cache full"):
        cache.skip(7)
    assert cache.length == 4


def test_placed_positions_move_to_their_rows_and_the_dead_rows_hold_places():
    cache = _filled(length=6)  # positions 2..5 stand for the 4 live rows just written of a 6-row forward
    cache.place(2, [0, 2, 3, 5], 6)
    assert cache.length == 8
    assert [_positions(cache)[i] for i in (0, 1, 2, 4, 5, 7)] == [0, 1, 2, 3, 4, 5]
    assert [cache.v[1, 0, 0, i, 0].item() for i in (2, 4, 5, 7)] == [-2, -3, -4, -5]
    cache.gather([0, 1, 2, 4, 5, 7])  # the pruning drops the dead rows
    assert _positions(cache) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match=r"cannot place 2 positions at 5 as rows of 3 \(length 6\)"):
        cache.place(5, [0, 1], 3)
    with pytest.raises(ValueError, match="cannot place 1 positions at 5 as rows of 2"):
        cache.place(5, [2], 2)
    with pytest.raises(KVBudgetExceeded, match="session KV cache full"):
        cache.place(6, [], 5)
    assert cache.length == 6


def test_pool_budget_refuses_and_release_frees():
    # k and v, layers, heads, slots (capacity 10 + the trash slot, rounded up to 16), dim, fp32 bytes
    per_session = 2 * 2 * 1 * 16 * 2 * 4
    pool = KVPool(budget_bytes=2 * per_session)
    a, b = _filled(pool=pool), _filled(pool=pool)
    assert pool.used_bytes == 2 * per_session and pool.sessions == 2
    with pytest.raises(KVBudgetExceeded, match=r"KV cache budget exhausted: .* retry later"):
        _filled(pool=pool)
    a.release()
    a.release()  # idempotent
    assert pool.used_bytes == per_session and pool.sessions == 1
    del b
    assert pool.used_bytes == 0 and pool.sessions == 0
