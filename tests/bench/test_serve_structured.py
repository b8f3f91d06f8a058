"""`tandem bench serve --structured-outputs json`: every request carries one of the bench's JSON schemas, round
robin, through context fitting and into its body; against a real `tandem serve` every request succeeds."""
from __future__ import annotations

import json
import subprocess

from cluster.bench.serve import with_schemas
from cluster.bench.serve_client import _request_body
from cluster.bench.serve_workloads import SampleRequest, fit_to_context
from cluster.bench.structured import SCHEMAS
from tests.support.serve_process import TANDEM


def test_schemas_go_round_robin_survive_fitting_and_reach_the_body():
    samples = with_schemas([SampleRequest(tuple(range(n)), 4) for n in (3, 30, 5, 8)])
    assert [s.structured_outputs for s in samples] == [{"json": SCHEMAS[i % len(SCHEMAS)]} for i in range(4)]
    fitted, cut = fit_to_context(samples, 16)
    assert cut == 1 and fitted[1].prompt_token_ids == tuple(range(12))
    assert [s.structured_outputs for s in fitted] == [s.structured_outputs for s in samples]
    body = _request_body(fitted[2], "m", ignore_eos=False)
    assert body["structured_outputs"] == {"json": SCHEMAS[2]}
    assert "structured_outputs" not in _request_body(SampleRequest((1,), 2), "m", ignore_eos=False)


def test_bench_serve_with_a_structured_workload_against_tandem_serve(tmp_path, default_server_port):
    result_file = tmp_path / "result.json"
    done = subprocess.run([*TANDEM, "bench", "serve", "--base-url", f"http://127.0.0.1:{default_server_port}",
                           "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "24",
                           "--structured-outputs", "json", "--result-json", str(result_file)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    result = json.loads(result_file.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert 0 < result["total_output_tokens"] <= 6 * 24
