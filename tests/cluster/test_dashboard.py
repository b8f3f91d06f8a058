"""deploy/grafana/tandem.json is a Grafana dashboard over series Tandem really exports: every tandem_* name
in its queries is one a ServingMetrics renders (with a disaggregated backend's per-worker details and the
admission bound's), every panel sits on the 24-column grid, and the datasource is a variable (importable)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from cluster.api.metrics import ServingMetrics
from cluster.backend import BackendHealth, Timing

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tandem.json"


def exported_series() -> set[str]:
    metrics = ServingMetrics()
    metrics.observe_admitted(8)
    metrics.observe_first_token(0.1)
    metrics.observe_chunk(1, None)
    metrics.observe_chunk(1, 0.02)
    metrics.observe_finished(Timing(queue_ms=1, prefill_ms=2, transfer_ms=3, ttft_ms=6, kv_bytes=1 << 20,
                                    prefill_location="local", decode_cached_tokens=16), 0.5)
    metrics.observe_outcome("http", "length")
    workers = {"decode-0": {"role": "decode", "free_kv_blocks": 10, "total_kv_blocks": 16, "running_requests": 1,
                            "node_id": "n", "node_ip": "127.0.0.1"}}
    details = {"running_requests": 1, "waiting_requests": 0, "free_kv_blocks": 10, "total_kv_blocks": 16,
               "workers": workers, "requests_in_flight": 1, "max_pending_requests": 256,
               "scaling": {"workers": {"decode-0": {"role": "decode", "state": "serving"}},
                           "bounds": {"decode": {"min": 1, "max": 2}},
                           "autoscale_decisions": [{"role": "decode", "action": "add", "outcome": "applied",
                                                    "count": 1}]}}
    text = metrics.render(BackendHealth(True, "m", 1, 1, details)).decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def test_every_query_names_series_tandem_exports():
    exported = exported_series()
    queries = [target["expr"] for panel in panels() for target in panel.get("targets", [])]
    assert len(queries) >= 20
    used = {name for query in queries for name in re.findall(r"\btandem_\w+", query)}
    assert used and used <= exported, sorted(used - exported)
    for wanted in ("tandem_time_to_first_token_seconds_bucket", "tandem_inter_token_latency_seconds_bucket",
                   "tandem_e2e_request_latency_seconds_bucket", "tandem_kv_transfer_time_seconds_bucket",
                   "tandem_kv_transfer_bytes_total", "tandem_waiting_requests", "tandem_worker_kv_free_blocks",
                   "tandem_requests_total", "tandem_requests_in_flight", "tandem_kv_transfer_exposed_seconds_bucket",
                   "tandem_prefill_decisions_total", "tandem_decode_cached_prompt_tokens_total", "tandem_workers",
                   "tandem_autoscale_decisions_total"):
        assert wanted in used, wanted
    for query in queries:
        assert query.count("(") == query.count(")") and query.count("{") == query.count("}"), query


def test_panels_fit_the_grid_and_use_the_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "Tandem"
    assert "datasource" in {variable["name"] for variable in dashboard["templating"]["list"]}
    ids = [panel["id"] for panel in panels()]
    assert len(ids) == len(set(ids))
    for panel in panels():
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["description"], panel["title"]
