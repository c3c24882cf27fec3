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
from specctl.net.protocol import Proposal, Propose, Tensor
from specctl.spec.decode import generate
from specctl.spec.drafters import ModelChainDrafter
from specctl.spec.sampling import SamplingParams
from specctl.verify.client import remote_generate


def sample_proposal(nodes: int = 64, vocab: int = 151936, with_q: bool = False) -> Proposal:
    tokens = torch.randint(0, vocab, (nodes,)).tolist()
    parents = [-1] + [(i - 1) // 4 for i in range(1, nodes)]
    q = Tensor.from_torch(torch.rand(4, 1024)) if with_q else None
    return Proposal(1, tokens, parents, [0.5] * nodes, q)


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


def overhead(target, draft, target_name: str, draft_name: str, prompts: list[list[int]], max_tokens: int,
             depth: int, dtype: str) -> dict:
    """tokens/s of the pair in one process vs separate processes; same prompts, greedy."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    drafter = ModelChainDrafter(draft.decoder, depth)
    generate(target.decoder, prompts[0][:8], SamplingParams(max_tokens=4), drafter)
    start, tokens, local_out = time.perf_counter(), 0, []
    for ids in prompts:
        out, _, _ = generate(target.decoder, ids, params, drafter)
        tokens += len(out)
        local_out.append(out)
    local = tokens / (time.perf_counter() - start)
    # Same threads as the one-process run: draft and target alternate, they do not overlap.
    # The same draft as the one-process run: unquantized (the draft role's profile default is int8).
    settings = StarBenchSettings(draft_name, target_name, (1,), depth, max_tokens, 0.0, dtype, max_batches=(1,),
                                 draft_quant="none", threads=torch.get_num_threads())
    with StarCluster(settings, max_batch=1) as cluster:
        async def remote_run() -> tuple[float, list]:
            port = cluster.target_ports[0]
            await remote_generate("127.0.0.1", port, prompts[0][:8], SamplingParams(max_tokens=4))
            begin, count, outs = time.perf_counter(), 0, []
            for ids in prompts:
                out, _, _ = await remote_generate("127.0.0.1", port, ids, params)
                count += len(out)
                outs.append(out)
            return count / (time.perf_counter() - begin), outs

        remote, remote_out = asyncio.run(remote_run())
    return {"one_process_tokens_per_s": round(local, 3), "separate_processes_tokens_per_s": round(remote, 3),
            "ratio": round(remote / local, 3), "outputs_identical": local_out == remote_out,
            "prompts": len(prompts), "max_tokens": max_tokens, "depth": depth, "dtype": dtype}
