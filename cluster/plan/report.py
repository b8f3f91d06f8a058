"""What `tandem plan` prints: the profile's curves, the table of deployments, the recommendation; and the JSON."""
from __future__ import annotations

import math
import statistics
from collections import defaultdict

from cluster.plan.deployment import Deployment
from cluster.plan.predict import Prediction, Recommendation, Slos
from cluster.plan.profile import EngineProfile
from cluster.plan.simulator import ServingShape
from cluster.plan.step_model import OUTLIER_RATIO, StepTimeModel, StepWork
from cluster.plan.tp_model import TpCost

_HEADER = (f"{'deployment':<24} {{unit:>13}} {'goodput':>8} {'meet SLOs':>9} {'req/s':>6} {'TTFT p50':>9} "
           f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'TPOT p50':>9} {'KV ms':>6}")


def format_profile(profile: EngineProfile, model: StepTimeModel) -> str:
    """Per grid point: prefill tokens/s and decode / mixed ms per step, measured (medians) and the fit's."""
    points = defaultdict(list)
    for step in profile.steps:
        points[(step.phase, step.point)].append(step)
    outliers = profile.outliers()
    lines = [f"profile: {profile.model} on {profile.device} ({profile.dtype}, {profile.cpu_threads} thread(s)), "
             f"{len(profile.steps)} steps measured"]
    if outliers:
        lines.append(f"  {len(outliers)} step(s) ran over {OUTLIER_RATIO}x the fit and were left out of it "
                     "(something else was running? profile on an idle machine)")
    for phase, words in (("prefill", "prompts x length -> prefill tokens/s"),
                         ("decode", "batch x context -> ms per decode step"),
                         ("mixed", "decodes x context + prompt length -> ms per step")):
        lines.append(f"  {words}, measured / fit:")
        for (kind, point), steps in points.items():
            if kind != phase:
                continue
            measured = statistics.median(s.seconds for s in steps)
            fitted = statistics.median(model.seconds(s.work) for s in steps)
            if phase == "prefill":
                tokens = statistics.median(sum(n for n, _ in s.work.prefill_chunks) for s in steps)
                lines.append(f"    {point:>14} -> {tokens / measured:9.0f} / {tokens / fitted:9.0f}")
            else:
                lines.append(f"    {point:>14} -> {measured * 1e3:9.2f} / {fitted * 1e3:9.2f}")
    lines.append("  fit, seconds per unit: " + ", ".join(f"{k} {v:.3g}" for k, v in model.as_dict().items()))
    return "\n".join(lines)


def format_serving(shapes: dict[str, ServingShape], calibrated: dict) -> str:
    """The host's cores and, per kind of deployment, the serving path's costs and where they came from."""
    host = next(iter(shapes.values())).host
    lines = [f"host: {host.cores:g} cores shared by the workers' steps ({host.worker_threads} thread(s) each), KV "
             f"transfers ({host.transfer_threads} threads each) and the serving path"]
    for kind, shape in shapes.items():
        costs = shape.costs.as_dict()
        source = "calibrated" if kind in calibrated else "not calibrated: engine-bound, see --calibrate"
        lines.append(f"serving path, {kind}: {costs['request_cpu_ms']:.2f} ms CPU per request, "
                     f"{costs['token_cpu_ms']:.3f} per token, {costs['step_cpu_ms']:.3f} per step, "
                     f"{costs['baseline_cores']:.3f} cores idle; "
                     f"{costs['request_overhead_ms']:.1f} ms before each first token, "
                     f"{costs['step_overhead_ms']:.2f} ms per step (lognormal, sigma "
                     f"{costs['step_overhead_sigma']:.1f}) ({source})")
    return "\n".join(lines)


def format_tp(devices: int, unit: str, costs: tuple[TpCost, ...], sizes: tuple[int, ...]) -> str:
    """The budget, and per TP size the deployments use, what its collectives add to a step and from where."""
    lines = [f"budget: {devices} {unit}; a worker of TP size T takes T of them"]
    for cost in costs:
        if cost.tp in sizes:
            lines.append(f"TP={cost.tp} step: compute / {cost.tp} + {cost.step_s * 1e3:.3f} ms + "
                         f"{cost.token_s * 1e6:.2f} us per token row ({cost.source})")
    return "\n".join(lines)


def gpus_column(deployment: Deployment) -> str:
    """Devices per role: '2P+2D=4' (prefill + decode workers' devices = all), '4' (the replicas')."""
    d = deployment
    if d.is_disaggregated:
        return f"{d.prefill_devices}P+{d.decode_devices}D={d.num_devices}"
    return f"{d.num_devices}"


def format_table(predictions: list[Prediction], recommendation: Recommendation, slos: Slos,
                 unit: str = "devices") -> str:
    """One row per deployment (its GPUs per role, ms, goodput in req/s), the recommendation or why there is
    none."""
    rows = [_HEADER.format(unit=unit)]
    for p in predictions:
        m = p.metrics
        mark = " *" if p is recommendation.prediction else ""
        rows.append(f"{p.deployment.name + mark:<24} {gpus_column(p.deployment):>13} {p.goodput:8.2f} "
                    f"{p.attainment:8.0%} {m.request_throughput:6.2f} "
                    f"{m.ttft.median:9.1f} {m.ttft.p99:9.1f} {m.itl.median:8.1f} {m.itl.p99:8.1f} "
                    f"{m.tpot.median:9.1f} {p.mean_transfer_ms:6.1f}")
    best = recommendation.prediction
    target = (f"TTFT <= {slos.ttft_ms:g} ms and ITL (mean per request) <= {slos.itl_ms:g} ms for "
              f"{slos.attainment:.0%} of requests")
    if recommendation.meets_slos:
        rows.append(f"recommendation: {best.deployment.name} on {best.deployment.num_devices} {unit} "
                    f"({best.goodput:.2f} req/s within the SLOs: {target})")
    else:
        rows.append(f"no deployment meets the SLOs ({target}); the closest is {best.deployment.name}: "
                    f"{best.attainment:.0%} of requests within them, TTFT p99 {best.metrics.ttft.p99:.1f} ms, "
                    f"TPOT p99 {best.metrics.tpot.p99:.1f} ms")
    return "\n".join(rows)


def plan_json(predictions: list[Prediction], recommendation: Recommendation, slos: Slos, context: dict) -> dict:
    """Everything the table says, and the inputs (`context`: model, workers, workload, profile, transfer)."""
    best = recommendation.prediction.deployment.name
    return {**context, "slos": {"ttft_ms": slos.ttft_ms, "itl_ms": slos.itl_ms, "attainment": slos.attainment},
            "deployments": [_prediction_json(p) for p in predictions],
            "recommendation": best if recommendation.meets_slos else None,
            "meets_slos": recommendation.meets_slos, "closest": None if recommendation.meets_slos else best}


def _prediction_json(p: Prediction) -> dict:
    m = p.metrics
    finite = lambda v: v if math.isfinite(v) else None  # noqa: E731
    d = p.deployment
    return {"name": d.name, "prefill_workers": d.num_prefill, "decode_workers": d.num_decode,
            "prefill_tp": d.prefill_tp, "decode_tp": d.decode_tp, "prefill_gpus": d.prefill_devices,
            "decode_gpus": d.decode_devices, "gpus": d.num_devices, "disaggregated": d.is_disaggregated,
            "goodput": finite(p.goodput), "slo_attainment": p.attainment,
            "request_throughput": finite(m.request_throughput), "duration_s": m.duration,
            "ttft_p50_ms": m.ttft.median, "ttft_p99_ms": m.ttft.p99, "itl_p50_ms": m.itl.median,
            "itl_p99_ms": m.itl.p99, "tpot_p50_ms": m.tpot.median, "tpot_p99_ms": m.tpot.p99,
            "mean_transfer_ms": p.mean_transfer_ms}


def sample_curves(model: StepTimeModel) -> dict:
    """The fitted curves at a few points (for the JSON): prefill tokens/s at fresh prompts of 256 tokens packed
    up to each size, decode step ms at each batch with 512-token contexts."""
    prefill = {tokens: tokens / model.seconds(StepWork(((256, 0),) * (tokens // 256))) for tokens in (256, 1024, 2048)}
    decode = {batch: model.seconds(StepWork((), (512,) * batch)) * 1e3 for batch in (1, 8, 32, 128)}
    return {"prefill_tokens_per_s": prefill, "decode_step_ms_at_512": decode}
