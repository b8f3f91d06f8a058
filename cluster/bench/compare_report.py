"""The results of `tandem bench compare`: the markdown table, the side-by-side ratios with the issue's
goal check, and the JSON.

Goal (disaggregated vs colocated, same workload and rate): p99 ITL at most half, median TTFT at most 25%
higher (TTFT is measured at the client, so the KV transfer is in it). The colocated baseline is the
in-process engine without chunking when it ran (the issue's original goal), else the colocated replicas
(`colocated-<N>`, the same hardware as the disaggregated modes).
"""
from __future__ import annotations

import dataclasses
import math
import re

from cluster.bench.serve_metrics import BenchmarkMetrics, RequestResult
from cluster.bench.serve_multiturn import multiturn_markdown
from cluster.bench.serve_report import RunSettings, result_json

GOAL_ITL_P99_RATIO = 0.5
GOAL_TTFT_MEDIAN_RATIO = 1.25
BASELINE = "colocated"
_REPLICAS = re.compile(r"^colocated-\d+$")


@dataclasses.dataclass(frozen=True)
class ModeRun:
    """One mode at one request rate: its metrics, the raw per-request results (for the plots),
    whether the server's KV pool was whole after the run (None: not reported), and the hardware the
    mode got (compare_modes.ServingMode.hardware)."""

    mode: str
    rate: float
    metrics: BenchmarkMetrics
    results: list[RequestResult]
    pool_whole: bool | None
    hardware: str = ""

    def summary_line(self) -> str:
        m = self.metrics
        return (f"{m.completed} ok, {m.failed} failed, {m.output_throughput:.1f} out tok/s, TTFT p50 "
                f"{m.ttft.median:.1f} ms, ITL p99 {m.itl.p99:.1f} ms, KV pool whole: {_yes_no(self.pool_whole)}")


def _yes_no(value: bool | None) -> str:
    return "n/a" if value is None else ("yes" if value else "NO")


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


_TABLE_HEADER = ("| mode | hardware | rate | ok / failed | req/s | goodput | out tok/s | TTFT p50 / p99 ms | "
                 "TPOT p50 / p99 ms | ITL p99 ms | transfer p50 / p99 ms | exposed p50 / p99 ms | "
                 "exposed % of TTFT p50 | KV pool whole |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def _table_row(run: ModeRun) -> str:
    m, d = run.metrics, run.metrics.disagg
    goodput = "-" if m.request_goodput is None else f"{m.request_goodput:.2f}"
    disagg = d.requests_with_timing > 0 and d.transfer_ms_p99 > 0  # some prompt's KV was moved
    transfer = f"{d.transfer_ms_p50:.1f} / {d.transfer_ms_p99:.1f}" if disagg else "-"
    exposed = f"{d.transfer_exposed_ms_p50:.1f} / {d.transfer_exposed_ms_p99:.1f}" if disagg else "-"
    share = f"{100 * d.transfer_share_of_ttft_p50:.1f}%" if disagg else "-"
    return (f"| {run.mode} | {run.hardware or '-'} | {_rate(run.rate)} | {m.completed} / {m.failed} | "
            f"{m.request_throughput:.2f} | "
            f"{goodput} | {m.output_throughput:.1f} | {m.ttft.median:.1f} / {m.ttft.p99:.1f} | "
            f"{m.tpot.median:.1f} / {m.tpot.p99:.1f} | {m.itl.p99:.1f} | {transfer} | {exposed} | {share} | "
            f"{_yes_no(run.pool_whole)} |")


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


def ratio_rows(runs: list[ModeRun]) -> list[tuple[float, str, str, float, float, float]]:
    """(rate, disaggregated mode, colocated mode, p99 ITL ratio, median TTFT ratio, out tok/s ratio)
    for every disaggregated x colocated pair measured at the same rate."""
    rows = []
    for run in runs:
        if not run.mode.startswith("disagg-"):
            continue
        for base in runs:
            if base.rate == run.rate and base.mode.startswith("colocated"):
                rows.append((run.rate, run.mode, base.mode,
                             _ratio(run.metrics.itl.p99, base.metrics.itl.p99),
                             _ratio(run.metrics.ttft.median, base.metrics.ttft.median),
                             _ratio(run.metrics.output_throughput, base.metrics.output_throughput)))
    return rows


def goal_baseline(runs: list[ModeRun]) -> str | None:
    """The colocated mode the goal is checked against: the in-process engine without chunking when it ran,
    else the first colocated replicas mode (colocated-<N>), else None."""
    modes = [run.mode for run in runs]
    return BASELINE if BASELINE in modes else next((m for m in modes if _REPLICAS.match(m)), None)


def goal_lines(runs: list[ModeRun]) -> list[str]:
    """One verdict per disaggregated mode and rate against the goal's baseline (goal_baseline)."""
    lines, baseline = [], goal_baseline(runs)
    for rate, mode, base, itl, ttft, _ in ratio_rows(runs):
        if base != baseline:
            continue
        itl_ok, ttft_ok = itl <= GOAL_ITL_P99_RATIO, ttft <= GOAL_TTFT_MEDIAN_RATIO
        lines.append(f"- rate {_rate(rate)}, {mode} vs {base}: p99 ITL {itl:.2f}x (goal <= {GOAL_ITL_P99_RATIO}: "
                     f"{'met' if itl_ok else 'NOT met'}), median TTFT {ttft:.2f}x (goal <= "
                     f"{GOAL_TTFT_MEDIAN_RATIO}: {'met' if ttft_ok else 'NOT met'})")
    return lines or ["- goal not checked: it needs a colocated and a disagg-* mode at the same rate"]


def format_markdown(runs: list[ModeRun], command: str = "") -> str:
    """The results table, the ratio table and the goal verdicts."""
    parts = []
    if command:
        parts += ["```bash", command, "```", ""]
    parts += [_TABLE_HEADER, *(_table_row(run) for run in runs), ""]
    ratios = ratio_rows(runs)
    if ratios:
        parts += ["| rate | disaggregated | vs colocated | p99 ITL ratio | median TTFT ratio | out tok/s ratio |",
                  "|---:|---|---|---:|---:|---:|"]
        parts += [f"| {_rate(rate)} | {mode} | {base} | {itl:.2f}x | {ttft:.2f}x | {tput:.2f}x |"
                  for rate, mode, base, itl, ttft, tput in ratios]
        parts.append("")
    parts += [f"Goal (disaggregated vs {goal_baseline(runs) or 'colocated'}, same run):", *goal_lines(runs), ""]
    parts += multiturn_markdown(runs)
    parts.append("Latencies are measured at the HTTP client (vLLM's definitions); transfer = the server's "
                 "tandem_timing.transfer_ms (first byte -> ack; layer-streamed, mostly under the prefill), exposed "
                 "= transfer_exposed_ms (prefill step end -> ack: what the client waits for); KV pool whole = "
                 "free == total blocks on /metrics after the run.")
    return "\n".join(parts) + "\n"


def runs_json(runs: list[ModeRun], flags: dict) -> dict:
    """{"flags": ..., "runs": [{"mode", "request_rate", "pool_whole", **vLLM-style result keys}],
    "ratios": [...]}."""
    entries = []
    for run in runs:
        entry = {"mode": run.mode, "hardware": run.hardware, "pool_whole": run.pool_whole}
        entry.update(result_json(run.metrics, RunSettings(run.rate, flags.get("max_concurrency"),
                                                          flags.get("burstiness", 1.0))))
        entries.append(entry)
    finite = lambda value: value if math.isfinite(value) else None  # noqa: E731
    ratios = [{"request_rate": _rate(rate), "mode": mode, "baseline": base, "p99_itl_ratio": finite(itl),
               "median_ttft_ratio": finite(ttft), "output_throughput_ratio": finite(tput)}
              for rate, mode, base, itl, ttft, tput in ratio_rows(runs)]
    return {"flags": flags, "runs": entries, "ratios": ratios}
