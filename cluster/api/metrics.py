"""ServingMetrics: the Prometheus metrics of one serving process (GET /metrics), all named tandem_*.

Each instance has its own CollectorRegistry (nothing global), so tests and several servers in one
process never share counters. Per-request series are recorded by MeteredBackend; the load gauges are
read from BackendHealth.details at scrape time (keys: running_requests, waiting_requests,
free_kv_blocks, total_kv_blocks, and requests_in_flight / max_pending_requests of the admission bound,
cluster/api/admission.py; a missing key leaves its gauge unchanged; `workers`, a dict of worker
name -> {role, free_kv_blocks, total_kv_blocks, running_requests}, fills the per-worker gauges, labelled
worker and role; a worker no longer listed loses its series; with node_id / node_ip in its entry, a worker
also has tandem_worker_info{worker,role,node_id,node_ip} 1, saying which Ray node it runs on; the worker
set's states and the autoscaler's decisions: cluster/api/worker_set_metrics.py).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cluster.api.worker_set_metrics import WorkerSetMetrics
from cluster.backend import BackendHealth, Timing

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class ServingMetrics:
    """Counters, histograms and gauges; the observe_* calls are made from the asyncio loop."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("tandem_requests", "Requests that ended, by front end and outcome "
                                "(stop, length, cancelled, overloaded, invalid, unavailable, error)",
                                ["frontend", "outcome"], registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds",
                              "Arrival at the front end -> first token handed back", buckets=LATENCY_BUCKETS_S,
                              registry=r)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("tandem_e2e_request_latency_seconds", "Arrival -> last token",
                             buckets=E2E_BUCKETS_S, registry=r)
        self.queue = Histogram("tandem_queue_time_seconds", "Arrival -> first scheduled for prefill",
                               buckets=LATENCY_BUCKETS_S, registry=r)
        self.prefill = Histogram("tandem_prefill_time_seconds", "Prefill of the prompt up to the first token",
                                 buckets=LATENCY_BUCKETS_S, registry=r)
        self.transfer = Histogram("tandem_kv_transfer_time_seconds", "KV transfer prefill -> decode worker",
                                  buckets=LATENCY_BUCKETS_S, registry=r)
        self.transfer_exposed = Histogram("tandem_kv_transfer_exposed_seconds", "KV transfer time the client waits "
                                          "for: prompt's prefill step end -> KV landed on the decode worker",
                                          buckets=LATENCY_BUCKETS_S, registry=r)
        self.transfer_bytes = Counter("tandem_kv_transfer_bytes", "KV bytes moved between workers", registry=r)
        self.prefill_decisions = Counter("tandem_prefill_decisions", "Where finished requests were prefilled "
                                         "(the disaggregation policy's decision): remote or local",
                                         ["location"], registry=r)
        self.decode_cached_tokens = Counter("tandem_decode_cached_prompt_tokens", "Prompt tokens whose KV the "
                                            "decode worker already held (not transferred)", registry=r)
        self.running = Gauge("tandem_running_requests", "Requests scheduled and not finished", registry=r)
        self.waiting = Gauge("tandem_waiting_requests", "Requests admitted, not yet scheduled", registry=r)
        self.free_blocks = Gauge("tandem_kv_free_blocks", "Free KV cache blocks", registry=r)
        self.total_blocks = Gauge("tandem_kv_total_blocks", "KV cache blocks in the pool", registry=r)
        self.serving = Gauge("tandem_backend_serving", "1 while the backend serves, else 0", registry=r)
        self.in_flight = Gauge("tandem_requests_in_flight", "Requests admitted and not ended (all front ends)",
                               registry=r)
        self.max_pending = Gauge("tandem_max_pending_requests", "The admission bound: past it, 429", registry=r)
        labels = ["worker", "role"]
        self._worker_gauges = {
            "free_kv_blocks": Gauge("tandem_worker_kv_free_blocks", "Free KV blocks of one worker", labels,
                                    registry=r),
            "total_kv_blocks": Gauge("tandem_worker_kv_total_blocks", "KV blocks in one worker's pool", labels,
                                     registry=r),
            "running_requests": Gauge("tandem_worker_running_requests", "Requests one worker holds", labels,
                                      registry=r),
            "dropped_connections": Gauge(
                "tandem_worker_dropped_connections", "Connections a decode worker's listeners (its KV receiver, "
                "its decode channel) dropped before reading anything from them (no or wrong secret, garbage, "
                "too slow, not a peer), since it started", labels, registry=r)}
        self._worker_series: set[tuple[str, str]] = set()
        self._worker_node = Gauge("tandem_worker_info", "1 per serving worker: its role and the Ray node it runs on",
                                  ["worker", "role", "node_id", "node_ip"], registry=r)
        self._load_gauges = {"running_requests": self.running, "waiting_requests": self.waiting,
                             "free_kv_blocks": self.free_blocks, "total_kv_blocks": self.total_blocks,
                             "requests_in_flight": self.in_flight, "max_pending_requests": self.max_pending}
        self._worker_set = WorkerSetMetrics(r)

    def observe_admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def observe_chunk(self, num_tokens: int, seconds_since_previous: float | None) -> None:
        """A chunk of new tokens; seconds_since_previous is None for the first one (TTFT instead)."""
        self.generation_tokens.inc(num_tokens)
        if seconds_since_previous is not None and num_tokens > 0:
            self.itl.observe(seconds_since_previous / num_tokens)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_finished(self, timing: Timing | None, e2e_seconds: float) -> None:
        self.e2e.observe(e2e_seconds)
        if timing is not None:
            self.queue.observe(timing.queue_ms / 1e3)
            self.prefill.observe(timing.prefill_ms / 1e3)
            self.transfer.observe(timing.transfer_ms / 1e3)
            self.transfer_exposed.observe(timing.transfer_exposed_ms / 1e3)
            self.transfer_bytes.inc(timing.kv_bytes)
            self.decode_cached_tokens.inc(timing.decode_cached_tokens)
            if timing.prefill_location:
                self.prefill_decisions.labels(location=timing.prefill_location).inc()

    def observe_outcome(self, frontend: str, outcome: str) -> None:
        self.requests.labels(frontend=frontend, outcome=outcome).inc()

    def render(self, health: BackendHealth) -> bytes:
        """The Prometheus text exposition, load gauges taken from `health`."""
        self.serving.set(1 if health.serving else 0)
        for key, gauge in self._load_gauges.items():
            value = health.details.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                gauge.set(value)
        self._render_workers(health.details.get("workers") or {})
        self._worker_set.render(health.details)
        return generate_latest(self.registry)

    def _render_workers(self, workers: dict) -> None:
        series = {(name, str(load.get("role", ""))) for name, load in workers.items()}
        for stale in self._worker_series - series:  # a dead worker's series disappear
            for gauge in self._worker_gauges.values():
                gauge.remove(*stale)
        self._worker_series = series
        self._worker_node.clear()
        for name, load in workers.items():
            if "node_id" in load:
                self._worker_node.labels(worker=name, role=str(load.get("role", "")), node_id=str(load["node_id"]),
                                         node_ip=str(load.get("node_ip", ""))).set(1)
        for name, load in workers.items():
            for key, gauge in self._worker_gauges.items():
                if key in load:
                    gauge.labels(worker=name, role=str(load.get("role", ""))).set(load[key])
