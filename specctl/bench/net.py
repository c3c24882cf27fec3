"""``specctl bench net``: what the network costs.

1. Protocol round trip on loopback: a Propose out, a 64-node Proposal back (encode,
   frame, TCP, decode), p50/p99 over many round trips.
2. Overhead: the same draft/target pair and prompts, greedy, in one process versus a
   draft server and a target instance in separate processes on loopback (tokens/s)."""

from __future__ import annotations

import asyncio
import statistics
import time

import torch

from specctl.bench.star import StarBenchSettings, StarCluster
from specctl.net.framing import read_message, write_message
from specctl.net.protocol import Proposal, Propose
from specctl.spec.rounds import generate
from specctl.spec.drafters import ModelChainDrafter
from specctl.spec.params import SamplingParams
from specctl.verify.client import probe, remote_generate


def sample_proposal(nodes: int = 64, vocab: int = 151936) -> Proposal:
    tokens = torch.randint(0, vocab, (nodes,)).tolist()
    parents = [-1] + [(i - 1) // 4 for i in range(1, nodes)]
    return Proposal(1, tokens, parents)


async def round_trip_ms(iterations: int = 2000, nodes: int = 64) -> dict:
    reply = sample_proposal(nodes)

    async def serve(reader, writer):
        try:
            while True:
                await read_message(reader)
                await write_message(writer, reply)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = Propose(1, [0, 1, 2, 3], [11, 12, 13, 14, 15])
    times = []
    for i in range(iterations + 100):
        start = time.perf_counter()
        await write_message(writer, request)
        message = await read_message(reader)
        elapsed = time.perf_counter() - start
        assert isinstance(message, Proposal) and len(message.tokens) == nodes
        if i >= 100:  # warm-up
            times.append(elapsed * 1e3)
    writer.close()
    await writer.wait_closed()
    await asyncio.sleep(0.05)  # let the echo handler see EOF and finish
    server.close()
    await server.wait_closed()
    times.sort()
    return {"nodes": nodes, "iterations": iterations, "p50_ms": round(statistics.median(times), 4),
            "p99_ms": round(times[int(0.99 * len(times))], 4), "mean_ms": round(statistics.fmean(times), 4)}


async def _probe_both(draft_port: int, target_port: int) -> tuple:
    return await probe("127.0.0.1", draft_port), await probe("127.0.0.1", target_port)


def overhead(target, draft, target_name: str, draft_name: str, prompts: list[list[int]], max_tokens: int,
             depth: int, dtype: str, repeats: int = 3) -> dict:
    """tokens/s of the pair in one process vs separate processes; same prompts, greedy.

    Each turn runs every prompt on both sides, alternating which side goes first (AB BA
    AB ...), so that a machine that speeds up or slows down for a while (this one varies by
    20% from minute to minute) affects both alike; the ratio is of the totals."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    drafter = ModelChainDrafter(draft.decoder, depth)
    generate(target.decoder, prompts[0][:8], SamplingParams(max_tokens=4), drafter)

    local_draft = [0.0, 0]  # draft seconds, rounds: the one process's own draft cost per round

    def local_run(ids: list[int]) -> tuple[int, float, list]:
        begin = time.perf_counter()
        out, stats, _ = generate(target.decoder, ids, params, drafter)
        local_draft[0] += stats.draft_s
        local_draft[1] += stats.rounds
        return len(out), time.perf_counter() - begin, out

    async def remote_run(port: int, ids: list[int]) -> tuple[int, float, list]:
        begin = time.perf_counter()
        out, _, _ = await remote_generate("127.0.0.1", port, ids, params)
        return len(out), time.perf_counter() - begin, out

    # Same threads and OpenMP wait policy as this process, and the same unquantized draft
    # (the draft role's profile default is int8): only the process boundary differs.
    settings = StarBenchSettings(draft_name, target_name, (1,), depth, max_tokens, 0.0, dtype, max_batches=(1,),
                                 draft_quant="none", threads=torch.get_num_threads(), passive_omp=False)
    local, remote, identical = [], [], True
    with StarCluster(settings, max_batch=1) as cluster:
        port = cluster.target_ports[0]
        asyncio.run(remote_generate("127.0.0.1", port, prompts[0][:8], SamplingParams(max_tokens=4)))
        for turn in range(repeats):
            local.append([])
            remote.append([])
            for i, ids in enumerate(prompts):
                # Prompt by prompt, in the order AB BA AB ...: a slow minute hits both sides.
                for side in ("local", "remote") if (turn * len(prompts) + i) % 2 == 0 else ("remote", "local"):
                    if side == "local":
                        local[-1].append(local_run(ids))
                    else:
                        remote[-1].append(asyncio.run(remote_run(port, ids)))
            identical = identical and [r[2] for r in local[-1]] == [r[2] for r in remote[-1]]
        (_, draft_stats), (_, target_stats) = asyncio.run(_probe_both(cluster.draft_port, port))
    # What the target waited for proposals beyond the draft's own compute: framing, TCP,
    # both event loops and thread hand-offs. Unlike the ratio, machine noise hardly moves it.
    beyond_ms = 1e3 * (target_stats["proposal_wait_s"] - draft_stats["busy_s"]) / max(target_stats["rounds"], 1)

    def rate(turns: list) -> float:
        runs = [run for turn in turns for run in turn]
        return sum(count for count, _, _ in runs) / sum(seconds for _, seconds, _ in runs)

    return {"one_process_tokens_per_s": round(rate(local), 3), "separate_processes_tokens_per_s": round(rate(remote), 3),
            "ratio": round(rate(remote) / rate(local), 3), "outputs_identical": identical,
            "ratio_per_turn": [round(rate([r]) / rate([l]), 3) for l, r in zip(local, remote)],
            "one_process_tokens_per_s_per_turn": [round(rate([l]), 3) for l in local],
            "separate_processes_tokens_per_s_per_turn": [round(rate([r]), 3) for r in remote],
            "proposal_wait_beyond_draft_compute_ms_per_round": round(beyond_ms, 3),
            "draft_compute_ms_per_round": round(1e3 * draft_stats["busy_s"] / max(target_stats["rounds"], 1), 3),
            "one_process_draft_ms_per_round": round(1e3 * local_draft[0] / max(local_draft[1], 1), 3),
            "repeats": repeats, "threads": torch.get_num_threads(),
            "prompts": len(prompts), "max_tokens": max_tokens, "depth": depth, "dtype": dtype}
