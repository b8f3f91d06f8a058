"""A 1P1D serving smoke test on one GPU, for `make gpu-check`: `tandem serve` with one prefill and one decode
worker sharing the card (transport auto: CUDA IPC); its first ten requests one at a time, each's time to first
token taken with the server's own account of it, tandem_timing (issue 27: the first within 1.2x the tenth, nothing
compiled while serving; the H200 run of session 31 had the first 7x the tenth with no slow step); `tandem bench
serve` of the mixed dataset; then a clean stop. Writes OUT/serve.log, OUT/first_requests.json, OUT/bench_serve.log
and OUT/bench_serve.json; exits non-zero when the server did not come up, the benchmark failed, or the server did
not stop within 60 s. The serve log is also searched for torch's warning that a process ended while another still
mapped its CUDA memory (the ipc shutdown order).

    python deploy/gpu_serve_smoke.py --out OUT [--num-prompts 64] [--request-rate 16]
"""
from __future__ import annotations

import argparse
import http.server
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

TANDEM = [sys.executable, "-m", "cluster.cli"]
BANNER = re.compile(r"gRPC 127\.0\.0\.1:(\d+), HTTP http://127\.0\.0\.1:(\d+)/v1")
IPC_WARNING = "Producer process has been terminated before all shared CUDA tensors released"
START_TIMEOUT_S = 120
FIRST_REQUESTS, FIRST_PROMPT_TOKENS = 10, 512
PHASES = ("queue_ms", "prefill_ms", "transfer_ms", "transfer_exposed_ms", "ttft_ms")  # ttft_ms: as the server saw it


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=16.0)
    args = parser.parse_args()
    log_path = args.out / "serve.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen([*TANDEM, "serve", "--prefill-workers", "1", "--decode-workers", "1",
                                   "--gpus-per-worker", "0.5", "--transport", "auto", "--grpc-port", "0",
                                   "--http-port", "0"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            http_port = _wait_for_banner(log_path, server)
            client_first_use_ms = warm_client()
            firsts = first_requests(http_port, FIRST_REQUESTS)
            ttfts = [first["ttft_ms"] for first in firsts]
            (args.out / "first_requests.json").write_text(json.dumps(
                {"ttft_ms": ttfts, "first_over_tenth": ttfts[0] / ttfts[-1], "prompt_tokens": FIRST_PROMPT_TOKENS,
                 "client_first_use_ms": client_first_use_ms,
                 "phases_first": firsts[0]["phases"], "phases_last": firsts[-1]["phases"]}))
            bench = _bench(args, http_port)
        finally:
            stopped = _stop(server)
    warned = IPC_WARNING in log_path.read_text(errors="replace")
    print(f"bench serve rc={bench}, server stopped cleanly: {stopped}, ipc shutdown warning: {warned}")
    return 0 if bench == 0 and stopped and not warned else 1


def first_requests(http_port: int, count: int, prompt_tokens: int = 0) -> list[dict]:
    """`count` streamed completions sent one after another to a fresh server, each a prompt of its own random token
    ids (no prefix-cache hit) and 2 output tokens: per request its time to first token (ms, `ttft_ms`) and where
    the server says that time went (`phases`: tandem_timing's queue, prefill, transfer, its exposed part and the
    server's own TTFT, ms). Call warm_client first: the client's own first use of urllib is not the server's."""
    results = []
    for index in range(count):
        rng = random.Random(index)
        prompt = [rng.randrange(100, 250) for _ in range(prompt_tokens or FIRST_PROMPT_TOKENS)]
        body = json.dumps({"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        started, ttft, timing = time.perf_counter(), None, {}
        with urllib.request.urlopen(request, timeout=120) as reply:
            for line in reply:  # server-sent events: the first data line carries the first token, a later one timing
                if line.startswith(b"data: {"):
                    ttft = ttft if ttft is not None else (time.perf_counter() - started) * 1e3
                    timing = json.loads(line[len(b"data: "):]).get("tandem_timing") or timing
        phases = {name: round(timing[name], 3) for name in PHASES if isinstance(timing.get(name), (int, float))}
        results.append({"ttft_ms": ttft, "phases": phases})
    return results


def warm_client() -> float:
    """One request of this process's urllib to a throwaway HTTP server in this process (not Tandem), so that what a
    client's first request costs the client alone (its opener, the proxy lookup, first calls: ~5 ms on the 2-core
    CPU machine) is paid before the first timed one; in session 32 the H200 host's first request took 23.5 ms more
    at the client than the server counted. Returns that request's ms."""
    handler = type("Quiet", (http.server.BaseHTTPRequestHandler,), {
        "do_GET": lambda self: (self.send_response(204), self.end_headers()),
        "log_message": lambda self, *args: None})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        started = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/", timeout=30) as reply:
            reply.read()
        return (time.perf_counter() - started) * 1e3
    finally:
        server.shutdown()
        server.server_close()


def _wait_for_banner(log_path: Path, server: subprocess.Popen) -> int:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        match = BANNER.search(log_path.read_text(errors="replace"))
        if match:
            return int(match.group(2))
        if server.poll() is not None:
            raise SystemExit(f"tandem serve exited with {server.returncode} before listening: see {log_path}")
        time.sleep(0.5)
    raise SystemExit(f"tandem serve did not listen within {START_TIMEOUT_S} s: see {log_path}")


def _bench(args: argparse.Namespace, http_port: int) -> int:
    command = [*TANDEM, "bench", "serve", "--base-url", f"http://127.0.0.1:{http_port}", "--dataset-name", "mixed",
               "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
               "--result-json", str(args.out / "bench_serve.json")]
    with open(args.out / "bench_serve.log", "w") as log:
        return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=300).returncode


def _stop(server: subprocess.Popen) -> bool:
    """SIGINT, as a user's Ctrl-C; SIGKILL to the whole session after 60 s. True when it stopped by itself."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=60)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        return False


if __name__ == "__main__":
    sys.exit(main())
