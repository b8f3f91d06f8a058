"""`make gpu-check` without a GPU: the script's plumbing (env, steps under a budget, the report) and the report's
rendering of each step's output, from files shaped as the real steps write them."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.serve_process import start_serve

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str):
    """A deploy/ script as a module (deploy/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "deploy" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render_report(out: Path) -> str:
    """deploy/gpu_check_report.py's main(out)."""
    return load_script("gpu_check_report").main(out)


def test_a_spent_budget_skips_every_step_and_still_reports(tmp_path):
    env = {**os.environ, "GPU_CHECK_BUDGET_S": "5", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(REPO / "deploy" / "gpu_check.sh"), str(tmp_path / "out")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = (tmp_path / "out" / "report.md").read_text()
    assert "torch:" in report and "## GPU check" in report
    steps = [line.split("\t") for line in (tmp_path / "out" / "steps.tsv").read_text().splitlines()]
    assert [s[0] for s in steps] == ["selftest", "bench-engine", "bench-memory", "bench-transfer", "serve-1p1d",
                                     "pytest"]
    assert all(s[1].startswith("skipped") for s in steps)
    assert "no selftest.json" in report and "no pytest.log" in report


def test_only_the_steps_asked_for_run(tmp_path):
    env = {**os.environ, "GPU_CHECK_BUDGET_S": "5", "PYTHON": sys.executable, "GPU_CHECK_STEPS": "serve-1p1d,pytest"}
    done = subprocess.run(["bash", str(REPO / "deploy" / "gpu_check.sh"), str(tmp_path / "out")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    steps = [line.split("\t")[0] for line in (tmp_path / "out" / "steps.tsv").read_text().splitlines()]
    assert steps == ["serve-1p1d", "pytest"]


def test_the_report_carries_every_number(tmp_path):
    (tmp_path / "env.txt").write_text("card 0: NVIDIA H100 80GB HBM3, 79.1 GiB\ntorch: 2.11.0 CUDA 13.0\n")
    (tmp_path / "steps.tsv").write_text("selftest\t0\t73\tpython -m cluster.selftest\n"
                                        "pytest\t124\t240\tpython -m pytest\n")
    (tmp_path / "selftest.json").write_text(json.dumps({"checks": [
        {"name": "kernels triton fp32", "status": "PASS", "detail": "max |err| 5.4e-07"}]}))
    (tmp_path / "bench_engine.json").write_text(json.dumps({"num_requests": 48, "engine_tok_s": 4589.5, "limits": [
        {"phase": "decode step", "batch": "1 seqs x 128 ctx", "engine_ms": 3.1, "floor_ms": 0.3, "floor": "weights",
         "host_ms": 1.29, "device_ms": 1.49}],
        "step_profiles": [{"phase": "decode b=1", "steps": 8, "kernels": 250.0, "busy_ms": 1.402,
                           "top": [["_decode_attention_kernel", 24.0, 0.311]], "runtime": {"cudaGraphLaunch": 1.0},
                           "wall_ms": 1.75, "python": [["runtime/jit.py:580 run", 72.0, 0.412]]}]}))
    eager_mixed = {"phase": "mixed step", "batch": "32 dec + 512 prompt", "engine_ms": 12.5, "floor_ms": 3.5,
                   "floor": "decode + matmuls"}
    (tmp_path / "bench_engine_eager.json").write_text(json.dumps({"num_requests": 48, "engine_tok_s": 4100.0,
                                                                 "limits": [eager_mixed]}))
    (tmp_path / "memory.json").write_text(json.dumps({"shape": "llama-3-8b", "slowest_step_ms_during": 682.95,
                                                      "memory_plan": "KV cache 56183 blocks"}))
    (tmp_path / "transfer.json").write_text(json.dumps({  # kv_transfer.bench --json: the rows and the fitted cost
        "rows": [{"size_bytes": 1 << 16, "seconds": 0.0013, "gbps": 0.05, "baseline_gbps": 0.52, "bit_exact": True},
                 {"size_bytes": 1 << 20, "seconds": 0.00367, "gbps": 0.29, "baseline_gbps": 2.14, "bit_exact": True}],
        "cost": {"fixed_ms": 1.492, "per_byte_gbps": 20.31, "raw_fixed_ms": 0.313, "raw_per_byte_gbps": 3.11}}))
    (tmp_path / "bench_serve.json").write_text(json.dumps({"completed": 64, "failed": 0, "output_throughput": 512.0,
                                                           "median_ttft_ms": 20.5, "p99_ttft_ms": 850.0,
                                                           "disagg": {"transfer_ms_p50": 4.19}}))
    (tmp_path / "first_requests.json").write_text(json.dumps({"ttft_ms": [827.0, 16.5], "first_over_tenth": 50.12,
                                                              "prompt_tokens": 512, "client_first_use_ms": 4.5,
                                                              "phases_first": {"queue_ms": 1.5, "prefill_ms": 812.0},
                                                              "phases_last": {"queue_ms": 1.2, "prefill_ms": 6.1}}))
    (tmp_path / "pytest.log").write_text("....\nFAILED tests/engine/test_x.py::test_y\n"
                                         "1 failed, 345 passed in 226.72s\n")
    report = render_report(tmp_path)
    for expected in ("NVIDIA H100 80GB HBM3", "| selftest | ok | 73 |", "| pytest | timed out | 240 |",
                     "max \\|err\\| 5.4e-07", "4,590 useful tok/s", "| 3.10 | 1.29 | 1.49 | 0.30 | 10.3x |",
                     "**decode b=1**, per step: 250 kernels, 1.402 ms on the device; cudaGraphLaunch 1",
                     "| 0.311 | 24 | `_decode_attention_kernel` |", "682.95",
                     "host: 1.750 ms wall per step", "| 0.412 | 72 | `runtime/jit.py:580 run` |",
                     "prefill and mixed steps eager)", "| mixed step | 32 dec + 512 prompt | 12.50 |",
                     "KV cache 56183 blocks", "| 0.0625 | 1.30 | 0.05 | 0.52 | True |",
                     "| 1 | 3.67 | 0.29 | 2.14 | True |", "fixed cost 1.492 ms per transfer, then 20.31 GB/s",
                     "| completed / failed | 64 / 0 |",
                     "20.50 / 850.00", "| KV transfer p50 ms | 4.19 |",
                     "one at a time (512 tokens), ms | 827.0 / 16.5 (first / last 50.12) |",
                     "| the first one's tandem_timing, ms | queue 1.5, prefill 812.0 |",
                     "| the last one's tandem_timing, ms | queue 1.2, prefill 6.1 |",
                     "| the client's own first request (not to Tandem), ms | 4.50 |",
                     "`1 failed, 345 passed in 226.72s`",
                     "FAILED tests/engine/test_x.py::test_y"):
        assert expected in report, expected


def test_a_suite_cut_by_its_timeout_still_names_its_failures(tmp_path):
    """pytest -v under xdist writes each result as it ends; a run killed before -rfE's summary is still read."""
    (tmp_path / "pytest.log").write_text("[gw1] [  3%] FAILED tests/engine/test_a.py::test_one \n"
                                         "[gw2] [  4%] PASSED tests/engine/test_a.py::test_two \n"
                                         "[gw0] [  5%] ERROR tests/kv_transfer/test_b.py::test_three \n")
    report = render_report(tmp_path)
    assert "FAILED tests/engine/test_a.py::test_one" in report
    assert "ERROR tests/kv_transfer/test_b.py::test_three" in report and "test_two" not in report


def test_the_smoke_test_times_a_fresh_servers_first_requests():
    """deploy/gpu_serve_smoke.py's first_requests against a real `tandem serve` (the tiny model on CPU): one time to
    first token per request, each a streamed completion that did produce a token, and where the server says it
    went."""
    smoke = load_script("gpu_serve_smoke")
    assert smoke.warm_client() > 0  # its own throwaway server, started and stopped
    with start_serve("--device", "cpu") as (_, _, http_port):
        firsts = smoke.first_requests(http_port, 3, prompt_tokens=24)
    assert len(firsts) == 3 and all(first["ttft_ms"] > 0 for first in firsts)
    assert all(set(first["phases"]) >= {"queue_ms", "prefill_ms"} for first in firsts), firsts
