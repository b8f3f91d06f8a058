"""Output of `tandem bench serve`: vLLM's "Serving Benchmark Result" text block (same labels and
layout, so runs compare line for line) plus a Disaggregation section, and the result JSON."""
from __future__ import annotations

import dataclasses
import math

from cluster.bench.serve_metrics import BenchmarkMetrics, Distribution

_METRIC_SECTIONS = (("ttft", "TTFT", "Time to First Token"),
                    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                    ("itl", "ITL", "Inter-token Latency"),
                    ("e2el", "E2EL", "End-to-end Latency"))


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The run's knobs that the report echoes."""

    request_rate: float
    max_concurrency: int | None
    burstiness: float


def _row(label: str, value, fmt: str = ".2f") -> str:
    return "{:<40} {:<10{}}".format(label, value, fmt)


def _header(title: str, fill: str) -> str:
    return "{s:{c}^{n}}".format(s=f" {title} " if fill == "=" else title, n=50, c=fill)


def _distribution_rows(name: str, dist: Distribution) -> list[str]:
    return [_row(f"Mean {name} (ms):", dist.mean), _row(f"Median {name} (ms):", dist.median),
            _row(f"P90 {name} (ms):", dist.p90), _row(f"P99 {name} (ms):", dist.p99)]


def _disagg_rows(metrics: BenchmarkMetrics) -> list[str]:
    disagg = metrics.disagg
    return [_header("Disaggregation", "-"),
            _row("Requests with tandem_timing:", disagg.requests_with_timing, ""),
            _row("P50 queue (ms):", disagg.queue_ms_p50), _row("P99 queue (ms):", disagg.queue_ms_p99),
            _row("P50 prefill (ms):", disagg.prefill_ms_p50), _row("P99 prefill (ms):", disagg.prefill_ms_p99),
            _row("P50 KV transfer (ms):", disagg.transfer_ms_p50),
            _row("P99 KV transfer (ms):", disagg.transfer_ms_p99),
            _row("Mean KV bytes:", disagg.mean_kv_bytes, ".0f"),
            _row("KV transfer throughput (GB/s):", disagg.transfer_gb_per_s),
            _row("P50 exposed KV transfer (ms):", disagg.transfer_exposed_ms_p50),
            _row("P50 transfer share of TTFT (%):", 100 * disagg.transfer_share_of_ttft_p50),
            _row("P99 transfer share of TTFT (%):", 100 * disagg.transfer_share_of_ttft_p99)]


def format_report(metrics: BenchmarkMetrics, settings: RunSettings) -> str:
    """The text block, vLLM's rows first (in vLLM's order), then Disaggregation."""
    rows = [_header("Serving Benchmark Result", "="), _row("Successful requests:", metrics.completed, ""),
            _row("Failed requests:", metrics.failed, "")]
    if settings.max_concurrency is not None:
        rows.append(_row("Maximum request concurrency:", settings.max_concurrency, ""))
    if not math.isinf(settings.request_rate):
        rows.append(_row("Request rate configured (RPS):", settings.request_rate))
    rows += [_row("Benchmark duration (s):", metrics.duration),
             _row("Total input tokens:", metrics.total_input_tokens, ""),
             _row("Total generated tokens:", metrics.total_output_tokens, ""),
             _row("Request throughput (req/s):", metrics.request_throughput)]
    if metrics.request_goodput is not None:
        rows.append(_row("Request goodput (req/s):", metrics.request_goodput))
    rows += [_row("Output token throughput (tok/s):", metrics.output_throughput),
             _row("Total Token throughput (tok/s):", metrics.total_token_throughput)]
    for attribute, name, title in _METRIC_SECTIONS:
        rows += [_header(title, "-"), *_distribution_rows(name, getattr(metrics, attribute))]
    rows += [*_disagg_rows(metrics), "=" * 50]
    return "\n".join(rows)


def result_json(metrics: BenchmarkMetrics, settings: RunSettings) -> dict:
    """vLLM's result keys (`<mean|median|std|p90|p99>_<metric>_ms`, ...) plus a `disagg` object.
    `request_goodput` is vLLM's goodput key; `goodput` repeats it; both only with --goodput."""
    result = {"duration": metrics.duration, "completed": metrics.completed, "failed": metrics.failed,
              "total_input_tokens": metrics.total_input_tokens,
              "total_output_tokens": metrics.total_output_tokens,
              "request_throughput": metrics.request_throughput, "output_throughput": metrics.output_throughput,
              "total_token_throughput": metrics.total_token_throughput,
              "request_rate": "inf" if math.isinf(settings.request_rate) else settings.request_rate,
              "burstiness": settings.burstiness, "max_concurrency": settings.max_concurrency}
    if metrics.request_goodput is not None:
        result["request_goodput"] = result["goodput"] = metrics.request_goodput
    for attribute, _, _ in _METRIC_SECTIONS:
        dist = getattr(metrics, attribute)
        for stat in ("mean", "median", "std", "p90", "p99"):
            result[f"{stat}_{attribute}_ms"] = getattr(dist, stat)
    result["disagg"] = dataclasses.asdict(metrics.disagg)
    return result
