"""A 1P1D serving smoke test on one GPU, for `make gpu-check`: `tandem serve` with one prefill and one decode
worker sharing the card (transport auto: CUDA IPC), `tandem bench serve` of the mixed dataset against it, then a
clean stop. Writes OUT/serve.log, OUT/bench_serve.log and OUT/bench_serve.json; exits non-zero when the server
did not come up, the benchmark failed, or the server did not stop within 60 s. The serve log is also searched
for torch's warning that a process ended while another still mapped its CUDA memory (the ipc shutdown order).

    python deploy/gpu_serve_smoke.py --out OUT [--num-prompts 64] [--request-rate 16]
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

TANDEM = [sys.executable, "-m", "cluster.cli"]
BANNER = re.compile(r"gRPC 127\.0\.0\.1:(\d+), HTTP http://127\.0\.0\.1:(\d+)/v1")
IPC_WARNING = "Producer process has been terminated before all shared CUDA tensors released"
START_TIMEOUT_S = 120


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
            bench = _bench(args, http_port)
        finally:
            stopped = _stop(server)
    warned = IPC_WARNING in log_path.read_text(errors="replace")
    print(f"bench serve rc={bench}, server stopped cleanly: {stopped}, ipc shutdown warning: {warned}")
    return 0 if bench == 0 and stopped and not warned else 1


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
