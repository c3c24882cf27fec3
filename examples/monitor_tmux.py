"""The monitor's must-show: draft server, 2 target instances and a gateway as separate
processes (smollm2-135m fp32 pair), `specctl monitor` in an 80x24 tmux pane, frames
captured idle, under load, with one target killed, and after it restarts.
Run: python examples/monitor_tmux.py (needs tmux)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from specctl.bench.processes import free_ports, stop_processes

PY = sys.executable
SESSION = f"specctl-monitor-demo-{int(time.time())}"


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "specctl", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_line(proc: subprocess.Popen, needle: str) -> None:
    while needle not in (line := proc.stderr.readline()):
        if not line:
            raise SystemExit(f"process exited before printing {needle!r}")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining


def capture(title: str) -> None:
    pane = subprocess.run(["tmux", "capture-pane", "-p", "-t", SESSION], capture_output=True, text=True).stdout
    print(f"----- {title} " + "-" * (66 - len(title)))
    print("\n".join(line.rstrip() for line in pane.rstrip().splitlines()))


def load(base: str, stop: threading.Event) -> None:
    while not stop.is_set():
        body = json.dumps({"prompt": "def quicksort(items):", "max_tokens": 32, "temperature": 0}).encode()
        try:
            urllib.request.urlopen(urllib.request.Request(base + "/v1/completions", data=body,
                                                          headers={"Content-Type": "application/json"}), timeout=120).read()
        except OSError:
            time.sleep(0.2)


def main() -> None:
    draft_port, t1, t2, gw = free_ports(4)
    common = ["--dtype", "fp32", "--threads", "1"]
    procs = [spawn("draft", "--port", str(draft_port), "--model", "smollm2-135m@25", "--mode", "chain", "--depth", "4",
                   "--draft-quant", "none", *common)]
    wait_line(procs[0], "listening on")
    targets = {}
    for port in (t1, t2):
        targets[port] = spawn("verify", "--model", "smollm2-135m", "--draft", f"127.0.0.1:{draft_port}", "--port", str(port), *common)
        wait_line(targets[port], "listening on")
    gateway = spawn("gateway", "--target", f"127.0.0.1:{t1}", "--target", f"127.0.0.1:{t2}", "--port", str(gw))
    wait_line(gateway, "gateway for")
    procs += [*targets.values(), gateway]
    base = f"http://127.0.0.1:{gw}"
    stop = threading.Event()
    try:
        subprocess.run(["tmux", "new-session", "-d", "-s", SESSION, "-x", "80", "-y", "24",
                        f"{PY} -m specctl monitor --gateway {base}"], check=True)
        time.sleep(3)
        capture("idle")
        workers = [threading.Thread(target=load, args=(base, stop), daemon=True) for _ in range(3)]
        for worker in workers:
            worker.start()
        time.sleep(8)
        capture("3 clients, 8 s")
        time.sleep(4)
        capture("3 clients, 12 s")
        targets[t2].send_signal(signal.SIGKILL)
        time.sleep(4)
        capture(f"kill -9 target :{t2}")
        targets[t2] = spawn("verify", "--model", "smollm2-135m", "--draft", f"127.0.0.1:{draft_port}", "--port", str(t2), *common)
        procs.append(targets[t2])
        wait_line(targets[t2], "listening on")
        time.sleep(6)
        capture(f"target :{t2} restarted")
    finally:
        stop.set()
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
        stop_processes(procs, signal.SIGINT, 30)


if __name__ == "__main__":
    main()
