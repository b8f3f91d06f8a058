"""deploy/: the `ray job submit` entrypoint run stand-alone, and `tandem demo`'s serving mode, each as a
subprocess on the embedded default model (a local Ray on 127.0.0.1, gRPC on 127.0.0.1:0). The demo starts a Ray of
its own even where another one is announced (RAY_ADDRESS, or the address file of a Ray this machine runs), which a
bare ray.init() would join and then refuse the CPU count it was given."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def run_command(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=None if env is None else {**os.environ, **env})


def test_job_entrypoint_standalone_serves_every_request():
    done = run_command("deploy/job.py", "--requests", "3", "--max-tokens", "8", "--model", "tiny")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("req-")]
    assert len(rows) == 3 and all("prefill-0->decode-0" in row for row in rows), done.stdout
    assert "TTFT" in done.stdout and "transfer" in done.stdout
    assert "3/3 ok" in done.stdout and "KV pools empty" in done.stdout


def test_demo_serving_mode_prints_both_modes_and_empty_pools():
    done = run_command("-m", "cluster.cli", "demo", "--requests", "6", "--max-tokens", "8", "--model", "tiny",
                       env={"RAY_ADDRESS": "127.0.0.1:1"})  # another Ray, announced: not the demo's
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("disaggregated ") for line in lines), done.stdout
    assert any(line.startswith("colocated ") for line in lines), done.stdout
    assert any(line.startswith("KV pools empty:") for line in lines), done.stdout
