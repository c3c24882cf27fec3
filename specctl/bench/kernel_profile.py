"""``bench kernels --profile N``: where an AR step's time goes, kernel by kernel.

The step-time table says how far a step is from the bandwidth limit; this says why. N AR
steps of the fastest variant run under ``torch.profiler``: on CUDA the device's kernels
(graph replays included: CUPTI sees the kernels a graph launches) with their self time, on
the CPU the aten ops' self time. The report gives kernels per step, the device's busy time
per step against the step's wall time (the rest is launch and host time: what graphs and
fusion remove) and the kernels that take most of it, by name."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from specctl.bench.kernels import primed_cache
from specctl.engine.model import Decoder

TOP_KERNELS = 15


@dataclass(frozen=True, slots=True)
class KernelShare:
    name: str
    calls_per_step: float
    us_per_step: float
    share: float  # of the busy time per step


def summarize_kernels(rows: list[tuple[str, int, float]], steps: int, wall_us: float, top: int = TOP_KERNELS) -> dict:
    """``rows`` (name, calls, self µs over all ``steps``) -> the profile's report: per step the
    kernels launched, the busy time and its share of the wall time, the ``top`` names by time
    and what the rest add up to."""
    if steps < 1 or wall_us <= 0:
        raise ValueError(f"need steps >= 1 and a wall time > 0, got {steps} and {wall_us}")
    busy = sum(us for _, _, us in rows) / steps
    ranked = sorted(rows, key=lambda row: (-row[2], row[0]))
    shares = [KernelShare(name, calls / steps, us / steps, us / steps / busy if busy else 0.0)
              for name, calls, us in ranked[:top]]
    rest = ranked[top:]
    return {
        "steps": steps,
        "kernels_per_step": sum(calls for _, calls, _ in rows) / steps,
        "busy_us_per_step": busy,
        "wall_us_per_step": wall_us / steps,
        "busy_share_of_wall": min(1.0, busy * steps / wall_us),
        "top": [asdict(share) for share in shares],
        "rest": {"names": len(rest), "calls_per_step": sum(c for _, c, _ in rest) / steps,
                 "us_per_step": sum(us for _, _, us in rest) / steps},
    }


def profile_steps(decoder: Decoder, context: int, steps: int, top: int = TOP_KERNELS) -> dict:
    """Profile ``steps`` AR steps (one new token after ``context`` cached) of ``decoder`` as it
    is set up now (eager, graphs or graphs+compile), after three unprofiled ones."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = decoder.device.type == "cuda"
    generator = torch.Generator().manual_seed(0)
    cache = primed_cache(decoder, context, 2, generator)
    token, position = torch.randint(0, decoder.spec.vocab_size, (1,), generator=generator), torch.tensor([context])

    def step() -> None:
        int(decoder(token, position, cache)[-1].argmax())  # the host sync every real step has
        cache.truncate(context)

    def run_steps() -> float:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - started) * 1e6

    for _ in range(3):
        step()
    # The wall time is taken without the profiler: its own overhead (~1 ms a CUDA step) would
    # make the device look idle where it is not.
    wall_us = run_steps()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        profiled_us = run_steps()
    cache.release()
    kind = DeviceType.CUDA if on_cuda else DeviceType.CPU
    rows = []
    for event in prof.key_averages():
        if event.device_type != kind:
            continue
        us = event.self_device_time_total if on_cuda else event.self_cpu_time_total
        if us > 0:
            rows.append((event.key, event.count, float(us)))
    report = summarize_kernels(rows, steps, wall_us, top)
    report["profiled_wall_us_per_step"] = profiled_us / steps
    report["device_time"] = "CUDA kernels" if on_cuda else "CPU aten ops (self time)"
    report["unit"] = "kernels" if on_cuda else "aten ops"
    return report
