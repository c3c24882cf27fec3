"""``specctl up`` as a user runs it: a real process that prints its URLs, serves, and on
Ctrl-C closes every role and frees its ports."""

import json
import re
import signal
import socket
import subprocess
import sys
import urllib.request


def _started(proc) -> list[str]:
    """What ``up`` printed until it said it serves."""
    lines = []
    while "Ctrl-C to stop" not in (line := proc.stderr.readline()):
        assert line, "".join(lines)
        lines.append(line)
    return lines


def _gateway_port(lines: list[str]) -> int:
    """``up --port 0`` lets the OS pick: a port chosen by the test could be taken by one of the
    roles' own ephemeral ports before the gateway binds it (seen once in CI)."""
    (port,) = {int(m.group(1)) for line in lines if (m := re.search(r"gateway  http://127\.0\.0\.1:(\d+)/v1", line))}
    return port


def _complete(port: int, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=60).read())


def test_up_serves_then_shuts_down_cleanly_on_ctrl_c(tiny_dir):
    proc = subprocess.Popen([sys.executable, "-m", "specctl", "up", "--target", str(tiny_dir["llama"]),
                             "--draft", f"{tiny_dir['llama']}@2", "--mode", "chain", "--dtype", "fp32",
                             "--draft-quant", "none", "--targets", "2", "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = _started(proc)
        port = _gateway_port(lines)
        out = "".join(lines)
        assert out.count("  target   127.0.0.1:") == 2
        addresses = [line.split()[-1] for line in lines if line.strip().startswith(("draft ", "target "))]
        assert _complete(port, "hi", 5)["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[1]
        assert proc.returncode == 0, rest
        assert "stopped: every role closed, ports freed" in rest
        for host_port in [f"127.0.0.1:{port}", *addresses]:
            host, number = host_port.rsplit(":", 1)
            with socket.socket() as s:
                assert s.connect_ex((host, int(number))) != 0, f"{host_port} still listening"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_up_with_several_drafters_serves_and_shuts_down_cleanly(tiny_dir):
    drafters = f"{tiny_dir['llama-draft']},{tiny_dir['llama']}@2,ngram"
    proc = subprocess.Popen([sys.executable, "-m", "specctl", "up", "--target", str(tiny_dir["llama"]),
                             "--drafters", drafters, "--dtype", "fp32", "--draft-quant", "none", "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = _started(proc)
        port = _gateway_port(lines)
        out = "".join(lines)
        assert out.count("  draft    127.0.0.1:") == 2 and "ngram drafting for 1 x" in out
        assert _complete(port, "hello hello hello", 8)["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[1]
        assert proc.returncode == 0 and "stopped: every role closed, ports freed" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
