"""DESIGN §3, Threads: one compute thread per device owns every torch call; the event loop only
moves bytes and plain Python. A torch op on the loop's thread blocks every connection while it
runs, waits on a GPU, and may start a second OpenMP pool beside the compute thread's (which
once slowed every later decode step by half). The embedded cluster runs the gateway, the target
instances and the draft server on one loop; a TorchFunctionMode entered on that thread (torch
keeps modes per thread: the compute threads are not watched) records every torch call made
there while greedy, sampled, logprobs and structured requests run — chain with
pre-speculation, tree, several drafters fused at the target, and pipeline stages."""

import json
import threading
import traceback
import urllib.request

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specctl.cluster.embedded import ClusterConfig, ClusterThread
from specctl.config import build_config


class TorchCalls(TorchFunctionMode):
    """Every torch function or tensor method called while it is entered, with the specctl line
    that called it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        ours = [f for f in traceback.extract_stack() if "/specctl/" in f.filename]
        where = f"{ours[-1].filename.split('/specctl/')[-1]}:{ours[-1].lineno}" if ours else "?"
        self.calls.append(f"{getattr(func, '__qualname__', func)} at {where}")
        return func(*args, **(kwargs or {}))


def on_loop(loop, fn) -> None:
    """Run ``fn`` on the loop's thread and wait for it."""
    done = threading.Event()
    loop.call_soon_threadsafe(lambda: (fn(), done.set()))
    assert done.wait(10)


CONFIGS = {
    "chain-prespec": (dict(mode="chain", prespec_budget=8), 1),
    "tree": (dict(mode="tree", width=4, topk=2), 1),
    "multi": (dict(mode="multi", drafters="{draft},ngram,suffix"), 1),
    "pipeline": (dict(mode="tree", width=4, topk=2), 2),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def spied_cluster(request, tiny_dir):
    options, stages = CONFIGS[request.param]
    draft = str(tiny_dir["llama-draft"])
    options = {k: v.format(draft=draft) if isinstance(v, str) else v for k, v in options.items()}
    config = build_config(None, target=str(tiny_dir["llama"]), draft=draft, depth=3, dtype="fp32",
                          draft_quant="none", max_sessions=4, **options)
    thread = ClusterThread(config, ClusterConfig(targets=2, gateway_port=0, stages=stages))
    urls = thread.start()
    yield thread, urls, stages
    thread.stop()


def _post(base: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


REQUESTS = [
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 16, "temperature": 0}),
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 16, "temperature": 0.8, "seed": 1, "n": 2}),
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 16, "temperature": 0.7, "top_p": 0.9,
                         "logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                              "temperature": 0, "response_format": {"type": "json_object"}}),
]


def test_no_torch_call_runs_on_the_event_loop(spied_cluster):
    thread, urls, stages = spied_cluster
    spy = TorchCalls()
    on_loop(thread.loop, spy.__enter__)
    try:
        on_loop(thread.loop, lambda: torch.zeros(2))  # the spy sees the loop's thread: this is caught
        for path, body in REQUESTS:
            answer = _post(urls["gateway"], path, body)
            assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        on_loop(thread.loop, lambda: spy.__exit__(None, None, None))
    assert spy.calls[0].startswith("_VariableFunctionsClass.zeros")
    assert spy.calls[1:] == [], "torch calls on the event loop:\n" + "\n".join(sorted(set(spy.calls[1:]))[:20])
