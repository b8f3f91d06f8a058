"""Predictions per deployment and the recommendation.

A simulated run is scored by the same code that scores a measured one (cluster/bench/serve_metrics.py,
`vllm bench serve`'s definitions): TTFT, ITL pooled over every gap, TPOT per request, and goodput = the
requests meeting every SLO per second of the run. The ITL SLO is held against each request's mean
inter-token latency (vLLM's TPOT, which its goodput and DistServe's use), so `tandem bench serve
--goodput ttft:T tpot:I` measures the same goodput the planner predicts for `--ttft-slo-ms T --itl-slo-ms I`.

A deployment meets the SLOs when at least `attainment` of its requests meet both. The recommendation is the
deployment with the highest goodput among those that meet them (within GOODPUT_TIE of the best counts as a
tie, broken by the fewer devices, then the lower p99 TTFT); when none does, the closest is the one with the most
requests meeting both (ties again by devices, then p99 TTFT).
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.bench.serve_metrics import BenchmarkMetrics, RequestResult, compute_metrics, meets_slos
from cluster.plan.deployment import Deployment
from cluster.plan.simulator import RequestTrace, ServingShape, SimRequest, simulate
from cluster.plan.step_model import StepTimeModel

GOODPUT_TIE = 0.01  # goodputs within 1% of each other are a tie


@dataclass(frozen=True)
class Slos:
    """Per-request targets in milliseconds, and the share of requests that must meet both."""

    ttft_ms: float
    itl_ms: float
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if not self.ttft_ms > 0 or not self.itl_ms > 0:
            raise ValueError(f"--ttft-slo-ms and --itl-slo-ms must be > 0, got {self.ttft_ms} and {self.itl_ms}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--slo-attainment must be in (0, 1], got {self.attainment}")

    @property
    def as_goodput(self) -> dict[str, float]:
        """In `tandem bench serve --goodput`'s terms."""
        return {"ttft": self.ttft_ms, "tpot": self.itl_ms}


@dataclass(frozen=True)
class Prediction:
    """One deployment's simulated run: the bench metrics of it, and the share of requests meeting both SLOs."""

    deployment: Deployment
    metrics: BenchmarkMetrics
    attainment: float
    mean_transfer_ms: float

    @property
    def goodput(self) -> float:
        return self.metrics.request_goodput or 0.0

    def meets(self, slos: Slos) -> bool:
        return self.attainment >= slos.attainment


def predict(deployment: Deployment, requests: list[SimRequest], model: StepTimeModel, shape: ServingShape,
            slos: Slos) -> Prediction:
    """Simulates `deployment` on `requests` and scores the run."""
    results = [_as_result(trace) for trace in simulate(deployment, requests, model, shape)]
    duration = max(result.chunk_times[-1] for result in results)
    metrics = compute_metrics(results, duration, slos.as_goodput)
    attainment = sum(meets_slos(result, slos.as_goodput) for result in results) / len(results)
    shipped = [r for r in requests if r.output_len > 1] if deployment.is_disaggregated else []
    transfer_ms = sum(shape.transfer.seconds(r.prompt_len) for r in shipped) / len(shipped) * 1e3 if shipped else 0.0
    return Prediction(deployment, metrics, attainment, transfer_ms)


def _as_result(trace: RequestTrace) -> RequestResult:
    return RequestResult(True, trace.request.prompt_len, trace.request.arrival_s, trace.token_times,
                         (1,) * len(trace.token_times))


@dataclass(frozen=True)
class Recommendation:
    """The deployment to run, and whether it meets the SLOs (False: no deployment does; it is the closest)."""

    prediction: Prediction
    meets_slos: bool


def recommend(predictions: list[Prediction], slos: Slos) -> Recommendation:
    """The rule in the module docstring. ValueError on an empty list."""
    if not predictions:
        raise ValueError("nothing to recommend from: no predictions")
    meeting = [p for p in predictions if p.meets(slos)]
    if meeting:
        best = max(p.goodput for p in meeting)
        tied = [p for p in meeting if p.goodput >= best * (1 - GOODPUT_TIE)]
        return Recommendation(min(tied, key=_tie_break), True)
    most = max(p.attainment for p in predictions)
    tied = [p for p in predictions if p.attainment >= most - 1e-12]
    return Recommendation(min(tied, key=_tie_break), False)


def _tie_break(prediction: Prediction) -> tuple[int, float]:
    """Of tied deployments: the one on fewer devices (a split may leave some idle), then the lower p99 TTFT."""
    return prediction.deployment.num_devices, prediction.metrics.ttft.p99
