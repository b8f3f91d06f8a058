"""`tandem bench serve` as users run it: against a real `tandem serve` on loopback, and a closed port."""
from __future__ import annotations

import json
import socket
import subprocess

import pytest

from tests.support.serve_process import TANDEM, start_serve

LABELS = ("============ Serving Benchmark Result ============", "Successful requests:", "Benchmark duration (s):",
          "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
          "Output token throughput (tok/s):", "Total Token throughput (tok/s):",
          "---------------Time to First Token----------------", "Mean TTFT (ms):", "Median TTFT (ms):",
          "P99 TTFT (ms):", "Mean TPOT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):", "P99 ITL (ms):",
          "Mean E2EL (ms):", "Disaggregation", "P50 KV transfer (ms):")


def test_bench_serve_against_tandem_serve(tmp_path, default_server_port):
    result_file = tmp_path / "result.json"
    done = subprocess.run([*TANDEM, "bench", "serve", "--base-url", f"http://127.0.0.1:{default_server_port}",
                           "--num-prompts", "8", "--random-input-len", "32", "--random-output-len", "8", "--ignore-eos",
                           "--goodput", "ttft:60000", "--result-json", str(result_file)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for label in LABELS:
        assert label in done.stdout, label
    result = json.loads(result_file.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_input_tokens"] == 8 * 32 and result["total_output_tokens"] == 64
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert result[f"{stat}_{metric}_ms"] >= 0
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["request_throughput"] > 0 and result["goodput"] == result["request_throughput"]
    assert result["output_throughput"] * result["duration"] == pytest.approx(64)
    assert result["disagg"]["requests_with_timing"] == 8 and result["disagg"]["transfer_ms_p50"] == 0


def test_bench_serve_cuts_its_requests_to_the_served_context(tmp_path):
    """The mixed dataset's long prompts (96 tokens + 16 out) do not fit a server of max_model_len 64: they are
    cut to fit, and the output says so, instead of coming back as 400s."""
    result_file = tmp_path / "result.json"
    with start_serve("--max-model-len", "64") as (_, _, http_port):
        done = subprocess.run([*TANDEM, "bench", "serve", "--base-url", f"http://127.0.0.1:{http_port}",
                               "--dataset-name", "mixed", "--num-prompts", "8", "--mixed-long-fraction", "0.5",
                               "--mixed-long-len", "96", "--mixed-short-len", "16", "--random-output-len", "16",
                               "--ignore-eos", "--result-json", str(result_file)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "4 of 8 requests cut to the served model's context of 64 tokens" in done.stdout
    result = json.loads(result_file.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_input_tokens"] == 4 * 48 + 4 * 16 and result["total_output_tokens"] == 8 * 16


def test_bench_serve_against_a_closed_port_fails_clearly():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    done = subprocess.run([*TANDEM, "bench", "serve", "--base-url", f"http://127.0.0.1:{closed_port}",
                           "--num-prompts", "2"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"cannot reach a Tandem/OpenAI server at http://127.0.0.1:{closed_port}" in done.stderr


def test_bench_serve_rejects_invalid_flags():
    done = subprocess.run([*TANDEM, "bench", "serve", "--base-url", "http://127.0.0.1:1", "--goodput", "foo:1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--goodput" in done.stderr


def test_bench_serve_kills_a_decode_worker_half_way_and_reports_the_migrations(tmp_path):
    """--fault kill-decode@50% against a real disaggregated `tandem serve` (1 prefill + 2 decode workers):
    the victim's requests migrate, none fails, and the report says how many moved and what they waited."""
    result_file = tmp_path / "fault.json"
    with start_serve("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "2") \
            as (_, _, http_port):
        done = subprocess.run([*TANDEM, "bench", "serve", "--base-url", f"http://127.0.0.1:{http_port}",
                               "--num-prompts", "16", "--request-rate", "16", "--random-input-len", "32",
                               "--random-output-len", "96", "--ignore-eos", "--fault", "kill-decode@50%",
                               "--result-json", str(result_file)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "Requests migrated:" in done.stdout and "Longest token gap, migrated" in done.stdout
    result = json.loads(result_file.read_text())
    fault = result["fault"]
    assert fault["victim"] == "decode-0" and fault["fired_after_requests"] == 8
    assert result["failed"] == 0 and fault["failed"] == 0 and result["completed"] == 16
    assert fault["migrated"] >= 1 and fault["migrated_max_gap_ms"][0] > 0


def test_bench_serve_fault_needs_a_valid_spec_and_a_decode_worker():
    done = subprocess.run([*TANDEM, "bench", "serve", "--base-url", "http://127.0.0.1:1", "--fault", "kill-all@50%"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--fault must be" in done.stderr
