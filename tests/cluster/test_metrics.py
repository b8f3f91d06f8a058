"""ServingMetrics on its own: the per-worker load gauges follow BackendHealth.details["workers"]."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from cluster.api.metrics import ServingMetrics
from cluster.backend import BackendHealth

MODEL = "tandem-default"


def test_per_worker_gauges_follow_the_workers_listed_in_health():
    def workers_in(text: str) -> dict:
        return {s.labels["worker"]: s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == "tandem_worker_kv_free_blocks"}

    metrics = ServingMetrics()
    both = {"prefill-0": {"role": "prefill", "free_kv_blocks": 7, "total_kv_blocks": 8, "running_requests": 1},
            "decode-0": {"role": "decode", "free_kv_blocks": 5, "total_kv_blocks": 8, "running_requests": 2}}
    first = metrics.render(BackendHealth(True, MODEL, 1, 1, {"workers": both})).decode()
    assert workers_in(first) == {"prefill-0": 7, "decode-0": 5}
    survivor = {"decode-0": dict(both["decode-0"], free_kv_blocks=8)}
    second = metrics.render(BackendHealth(False, MODEL, 0, 1, {"workers": survivor})).decode()
    assert workers_in(second) == {"decode-0": 8}, "a dead worker's series must disappear"


def test_each_worker_says_which_ray_node_it_runs_on():
    def nodes_in(text: str) -> dict:
        return {s.labels["worker"]: (s.labels["role"], s.labels["node_id"], s.labels["node_ip"])
                for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "tandem_worker_info"}

    metrics = ServingMetrics()
    both = {"prefill-0": {"role": "prefill", "node_id": "n1", "node_ip": "10.0.0.1", "free_kv_blocks": 8},
            "decode-0": {"role": "decode", "node_id": "n2", "node_ip": "10.0.0.2", "free_kv_blocks": 8}}
    first = metrics.render(BackendHealth(True, MODEL, 1, 1, {"workers": both})).decode()
    assert nodes_in(first) == {"prefill-0": ("prefill", "n1", "10.0.0.1"), "decode-0": ("decode", "n2", "10.0.0.2")}
    second = metrics.render(BackendHealth(False, MODEL, 0, 1, {"workers": {"decode-0": both["decode-0"]}})).decode()
    assert nodes_in(second) == {"decode-0": ("decode", "n2", "10.0.0.2")}, "a dead worker's node series must go"
