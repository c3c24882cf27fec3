"""Row-exact attention alone: an older ``specctl_kernels/__init__.py`` (a git revision's, loaded
beside this checkout's) against this checkout's, alternated in one process. A layer's attention
for a tree of 16 nodes and for a chain of 11 rows after P cached keys, the 1.5B's shape (12
query heads, 2 KV heads, 128 dims, bf16). Prints min and median ms a layer.

    git show 54de967:specctl_kernels/__init__.py > /tmp/old_kernels_init.py
    python examples/row_attention_cost.py /tmp/old_kernels_init.py [--cached 512,2048] [--repeats 30]"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

from specctl_kernels import row_exact, tree_attention

TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10]


def tree_mask(parents: list[int], cached: int) -> torch.Tensor:
    """Each node sees the cached keys, its ancestors and itself."""
    mask = torch.zeros(len(parents), cached + len(parents), dtype=torch.bool)
    mask[:, :cached] = True
    for node in range(len(parents)):
        ancestor = node
        while ancestor >= 0:
            mask[node, cached + ancestor] = True
            ancestor = parents[ancestor]
    return mask


def timed(ways: dict, q, k, v, mask, repeats: int) -> str:
    times = {way: [] for way in ways}
    for _ in range(repeats):
        for way, attend in ways.items():
            start = time.perf_counter()
            attend(q, k, v, mask)
            times[way].append((time.perf_counter() - start) * 1e3)
    return ", ".join(f"{way} {min(t):.2f} / {statistics.median(t):.2f}" for way, t in times.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="an older specctl_kernels/__init__.py")
    parser.add_argument("--cached", default="512,2048", help="cached keys before the rows")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("old_kernels", args.old)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    ways = {"before": old.row_exact(tree_attention, prefill=True), "after": row_exact(tree_attention, prefill=True)}
    gen = torch.Generator().manual_seed(0)
    for cached in (int(c) for c in args.cached.split(",")):
        rows = len(TREE_PARENTS)
        q = torch.randn(1, 12, rows, 128, generator=gen).bfloat16()
        k, v = (torch.randn(1, 2, cached + rows, 128, generator=gen).bfloat16() for _ in range(2))
        tree = timed(ways, q, k, v, tree_mask(TREE_PARENTS, cached), args.repeats)
        chain = timed(ways, q[:, :, :11], k[:, :, : cached + 11], v[:, :, : cached + 11],
                      tree_mask(list(range(-1, 10)), cached), args.repeats)
        print(f"{cached} keys cached, ms a layer (min / median): tree of 16: {tree}; chain of 11: {chain}")


if __name__ == "__main__":
    main()
