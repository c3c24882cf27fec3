"""runtime.loop: a batch job beside a main-thread compute loop stops on Ctrl-C/SIGTERM, closing
what it started, and its compute still runs on the main thread."""

import asyncio
import os
import signal
import threading

import pytest

from specctl.runtime.compute import ComputeThread
from specctl.runtime.loop import run_job_with_compute


def _signal_when(started: threading.Event, sig: int) -> threading.Thread:
    def send() -> None:
        assert started.wait(10)
        os.kill(os.getpid(), sig)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_cancels_a_running_job_which_closes_what_it_started(sig):
    started, closed, ran_on = threading.Event(), [], []

    async def job(compute: ComputeThread) -> None:
        lane = compute.lane()
        ran_on.append(await lane.run(lambda: threading.current_thread() is threading.main_thread()))
        started.set()
        try:
            await asyncio.sleep(60)
        finally:
            closed.append("cluster closed")

    sender = _signal_when(started, sig)
    previous = signal.getsignal(sig)
    with pytest.raises(KeyboardInterrupt):
        run_job_with_compute(job, ComputeThread("test-compute", spawn=False))
    sender.join()
    assert closed == ["cluster closed"] and ran_on == [True]
    assert signal.getsignal(sig) is previous  # the handler is the one before the job


def test_a_job_that_ends_returns_and_one_that_fails_raises_its_error():
    done = []

    async def finishes(compute: ComputeThread) -> None:
        done.append(await compute.lane().run(lambda: 6 * 7))

    run_job_with_compute(finishes, ComputeThread("test-compute", spawn=False))
    assert done == [42]

    async def fails(compute: ComputeThread) -> None:
        raise ValueError("no prompts")

    with pytest.raises(ValueError, match="no prompts"):
        run_job_with_compute(fails, ComputeThread("test-compute", spawn=False))


def test_a_job_cancelled_while_its_compute_runs_leaves_the_compute_loop_serving():
    """The job's loop closes while the compute thread still runs its last call: the result has no
    one to go to and is dropped (it once raised "Event loop is closed" out of the compute loop)."""
    computing, release = threading.Event(), threading.Event()

    def slow() -> int:
        computing.set()
        assert release.wait(10)
        return 1

    async def job(compute: ComputeThread) -> None:
        await compute.lane().run(slow)

    def interrupt_then_release() -> None:
        assert computing.wait(10)
        os.kill(os.getpid(), signal.SIGINT)
        threading.Timer(0.5, release.set).start()  # after the cancelled job's loop has closed

    sender = threading.Thread(target=interrupt_then_release)
    sender.start()
    with pytest.raises(KeyboardInterrupt):
        run_job_with_compute(job, ComputeThread("test-compute", spawn=False))
    sender.join()
