"""Peak memory of the reference reward server (`python -m rlhf_engine.rewards.serve`) under many clients, each
sending a body near `--max_request_mb`: the server's bound (`--max_concurrent_requests`) is what keeps its memory
from growing with the number of clients (docs/rewards.md, "Serving").

The server runs in its own process with a reward function that holds each call for `--hold_s`, so that every
admitted request is in flight at once; the clients send together; the server's peak RSS (VmHWM) is read from /proc
after each round, with its idle RSS before. Rounds: `clients` = the limit (every request admitted), then twice the
limit (half refused with 503 and dropped unread), then twice the limit with the limit doubled (a control: the
peak follows the limit, not the clients). A new server per round.

    python bench/reward_server_memory.py --out bench/results/cpu/reward_server_memory.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HOLD_S = float(os.environ.get("RSM_HOLD_S", "3"))


def held_lengths(prompts, responses):
    """The server's reward function (imported by the server from this file): holds each call, then scores lengths."""
    time.sleep(HOLD_S)
    return [float(len(r)) for r in responses]


def rss_mb(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)\s+kB", f.read()).group(1)) / 1024


def post(port: int, data: bytes, out: list, i: int) -> None:
    head = (f"POST /score HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
            s.sendall(head + data)
            raw = b""
            while chunk := s.recv(1 << 16):
                raw += chunk
        out[i] = int(raw.split(b" ", 2)[1])
    except OSError as e:
        out[i] = f"{type(e).__name__}: {e}"


def one_round(clients: int, limit: int, body_mb: float, max_request_mb: float, hold_s: float) -> dict:
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""), RSM_HOLD_S=str(hold_s))
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_engine.rewards.serve", "--port", "0",
                             "--reward_fn", "reward_server_memory:held_lengths", "--concurrency", str(limit),
                             "--max_concurrent_requests", str(limit), "--max_request_mb", str(max_request_mb)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        port = int(line.rsplit(":", 1)[1].strip().rstrip("/"))
        idle = rss_mb(proc.pid, "VmRSS")
        # one response string of about body_mb: the body the trainer's client would send for a large batch
        data = json.dumps({"prompts": ["p"], "responses": ["x" * int(body_mb * (1 << 20) - 64)]}).encode()
        codes: list = [None] * clients
        threads = [threading.Thread(target=post, args=(port, data, codes, i)) for i in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.perf_counter() - t0
        peak = rss_mb(proc.pid, "VmHWM")
    finally:
        proc.terminate()
        proc.wait(30)
    names = [str(c) for c in codes]
    counts = {c: names.count(c) for c in sorted(set(names))}
    return {"clients": clients, "limit": limit, "body_mb": round(len(data) / (1 << 20), 2),
            "max_request_mb": max_request_mb, "idle_rss_mb": round(idle, 1), "peak_rss_mb": round(peak, 1),
            "peak_minus_idle_per_admitted_body": round((peak - idle) / min(clients, limit) / (len(data) / (1 << 20)),
                                                       2),
            "answers": counts, "seconds": round(took, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=32, help="--max_concurrent_requests of the server")
    ap.add_argument("--max_request_mb", type=float, default=16.0)
    ap.add_argument("--body_mb", type=float, default=15.5, help="each client's body (near the limit)")
    ap.add_argument("--hold_s", type=float, default=3.0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    # the limit's clients, twice as many (the peak must not grow), then twice the limit for them (it grows with it)
    rounds = [one_round(n, limit, a.body_mb, a.max_request_mb, a.hold_s)
              for n, limit in ((a.limit, a.limit), (2 * a.limit, a.limit), (2 * a.limit, 2 * a.limit))]
    for r in rounds:
        print(json.dumps(r))
    if a.out:
        from benchlib import machine_info

        with open(a.out, "w") as f:
            json.dump({"machine": machine_info(), "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
