"""The worker set in /metrics: workers per role and state, each worker's state, the autoscaler's decisions.

Read from BackendHealth.details["scaling"] at scrape time (the coordinator's Scaling.describe(): "workers",
name -> {role, state}; "bounds", role -> {min, max}; "autoscale_decisions", a list of {role, action,
outcome, count} while the autoscaler runs). A backend without it (one engine in the serve process) shows
none of these series.

    tandem_workers{role="decode",state="serving"} 2           every role of the cluster x every state below
    tandem_worker_state{worker="decode-2",role="decode",state="draining"} 1
    tandem_autoscale_decisions_total{role="decode",action="add",outcome="applied"} 3
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily

STATES = ("starting", "serving", "draining", "lost")


class WorkerSetMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._count = Gauge("tandem_workers", "Workers per role and state (starting, serving, draining, lost)",
                            ["role", "state"], registry=registry)
        self._state = Gauge("tandem_worker_state", "1 per worker, labelled with its state",
                            ["worker", "role", "state"], registry=registry)
        self._decisions: list[dict] = []
        registry.register(self)

    def render(self, details: dict) -> None:
        """Sets the series from one health's details (see the module docstring)."""
        scaling = details.get("scaling")
        if not isinstance(scaling, dict):
            return
        workers = scaling.get("workers") or {}
        self._count.clear()
        for role in scaling.get("bounds") or {}:
            for state in STATES:
                self._count.labels(role=role, state=state).set(
                    sum(1 for w in workers.values() if w.get("role") == role and w.get("state") == state))
        self._state.clear()
        for name, worker in workers.items():
            self._state.labels(worker=name, role=str(worker.get("role")), state=str(worker.get("state"))).set(1)
        self._decisions = list(scaling.get("autoscale_decisions") or [])

    def collect(self):
        """The decision counter (a custom collector: the counts are the autoscaler's own)."""
        family = CounterMetricFamily("tandem_autoscale_decisions", "Autoscaler decisions by role, action "
                                     "(add, drain) and outcome (applied, refused, failed)",
                                     labels=["role", "action", "outcome"])
        for decision in self._decisions:
            family.add_metric([str(decision["role"]), str(decision["action"]), str(decision["outcome"])],
                              decision["count"])
        yield family

    def describe(self):
        return []
