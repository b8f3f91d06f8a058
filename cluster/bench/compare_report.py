"""The results of `tandem bench compare`: the markdown table, the side-by-side ratios with the issue's
goal check, and the JSON.

Goal (disaggregated vs colocated, same workload and rate): p99 ITL at most half, median TTFT at most 25%
higher (TTFT is measured at the client, so the KV transfer is in it). The colocated baseline is the
in-process engine without chunking when it ran (the issue's original goal), else the colocated replicas
(`colocated-<N>`, the same hardware as the disaggregated modes). With repeats (`--repeats N`: every mode
once per round, rounds one after another), ratios pair the runs of one round, and the verdict is on the
median of the rounds' ratios: on a machine whose run-to-run spread is as large as the margins, one run
decides nothing.
"""
from __future__ import annotations

import dataclasses
import math
import re
import statistics

from cluster.bench.serve_metrics import BenchmarkMetrics, RequestResult
from cluster.bench.serve_multiturn import multiturn_markdown
from cluster.bench.serve_report import RunSettings, result_json

GOAL_ITL_P99_RATIO = 0.5
GOAL_TTFT_MEDIAN_RATIO = 1.25
BASELINE = "colocated"
_REPLICAS = re.compile(r"^colocated-\d+(-tp\d+)?$")


@dataclasses.dataclass(frozen=True)
class ModeRun:
    """One mode at one request rate: its metrics, the raw per-request results (for the plots),
    whether the server's KV pool was whole after the run (None: not reported), the hardware the mode got
    (compare_modes.ServingMode.hardware), the round it ran in (0-based, `--repeats`) and the devices its workers
    took (ServingMode.devices: GPUs, one per rank, or CPU rank shares; 0: the in-process engine)."""

    mode: str
    rate: float
    metrics: BenchmarkMetrics
    results: list[RequestResult]
    pool_whole: bool | None
    hardware: str = ""
    repeat: int = 0
    devices: int = 0

    def summary_line(self) -> str:
        m = self.metrics
        return (f"{m.completed} ok, {m.failed} failed, {m.output_throughput:.1f} out tok/s, TTFT p50 "
                f"{m.ttft.median:.1f} ms, ITL p99 {m.itl.p99:.1f} ms, KV pool whole: {_yes_no(self.pool_whole)}")


def _yes_no(value: bool | None) -> str:
    return "n/a" if value is None else ("yes" if value else "NO")


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


_TABLE_HEADER = ("| mode | hardware | GPUs | rate | ok / failed | req/s | goodput | out tok/s | TTFT p50 / p99 ms | "
                 "TPOT p50 / p99 ms | ITL p99 ms | transfer p50 / p99 ms | exposed p50 / p99 ms | "
                 "exposed % of TTFT p50 | KV pool whole |\n"
                 "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def _table_row(run: ModeRun, rounds: int = 1) -> str:
    m, d = run.metrics, run.metrics.disagg
    goodput = "-" if m.request_goodput is None else f"{m.request_goodput:.2f}"
    disagg = d.requests_with_timing > 0 and d.transfer_ms_p99 > 0  # some prompt's KV was moved
    transfer = f"{d.transfer_ms_p50:.1f} / {d.transfer_ms_p99:.1f}" if disagg else "-"
    exposed = f"{d.transfer_exposed_ms_p50:.1f} / {d.transfer_exposed_ms_p99:.1f}" if disagg else "-"
    share = f"{100 * d.transfer_share_of_ttft_p50:.1f}%" if disagg else "-"
    mode = f"{run.mode} #{run.repeat + 1}" if rounds > 1 else run.mode
    return (f"| {mode} | {run.hardware or '-'} | {run.devices or '-'} | {_rate(run.rate)} | "
            f"{m.completed} / {m.failed} | {m.request_throughput:.2f} | "
            f"{goodput} | {m.output_throughput:.1f} | {m.ttft.median:.1f} / {m.ttft.p99:.1f} | "
            f"{m.tpot.median:.1f} / {m.tpot.p99:.1f} | {m.itl.p99:.1f} | {transfer} | {exposed} | {share} | "
            f"{_yes_no(run.pool_whole)} |")


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


def ratio_rows(runs: list[ModeRun]) -> list[tuple[float, str, str, float, float, float]]:
    """(rate, disaggregated mode, colocated mode, p99 ITL ratio, median TTFT ratio, out tok/s ratio)
    for every disaggregated x colocated pair measured at the same rate in the same round."""
    rows = []
    for run in runs:
        if not run.mode.startswith("disagg-"):
            continue
        for base in runs:
            if base.rate == run.rate and base.repeat == run.repeat and base.mode.startswith("colocated"):
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


def median_ratio_rows(runs: list[ModeRun]) -> list[tuple[float, str, str, list[float], list[float], list[float]]]:
    """ratio_rows grouped over the rounds: (rate, mode, baseline, p99 ITL ratios, median TTFT ratios,
    out tok/s ratios), each list one ratio per round, in round order."""
    grouped: dict[tuple[float, str, str], list[tuple[float, float, float]]] = {}
    for rate, mode, base, itl, ttft, tput in ratio_rows(runs):
        grouped.setdefault((rate, mode, base), []).append((itl, ttft, tput))
    return [(rate, mode, base, *(list(column) for column in zip(*ratios)))
            for (rate, mode, base), ratios in grouped.items()]


def goal_lines(runs: list[ModeRun]) -> list[str]:
    """One verdict per disaggregated mode and rate against the goal's baseline (goal_baseline), on the
    median of the rounds' ratios (each round's listed) when there are several."""
    lines, baseline = [], goal_baseline(runs)
    for rate, mode, base, itls, ttfts, _ in median_ratio_rows(runs):
        if base != baseline:
            continue
        itl, ttft = statistics.median(itls), statistics.median(ttfts)
        itl_ok, ttft_ok = itl <= GOAL_ITL_P99_RATIO, ttft <= GOAL_TTFT_MEDIAN_RATIO
        line = (f"- rate {_rate(rate)}, {mode} vs {base}: p99 ITL {itl:.2f}x (goal <= {GOAL_ITL_P99_RATIO}: "
                f"{'met' if itl_ok else 'NOT met'}), median TTFT {ttft:.2f}x (goal <= "
                f"{GOAL_TTFT_MEDIAN_RATIO}: {'met' if ttft_ok else 'NOT met'})")
        if len(itls) > 1:
            line += (f"; medians of {len(itls)} rounds (p99 ITL {', '.join(f'{r:.2f}x' for r in itls)}; "
                     f"median TTFT {', '.join(f'{r:.2f}x' for r in ttfts)})")
        lines.append(line)
    return lines or ["- goal not checked: it needs a colocated and a disagg-* mode at the same rate"]


def format_markdown(runs: list[ModeRun], command: str = "") -> str:
    """The results table, the ratio table and the goal verdicts."""
    parts = []
    if command:
        parts += ["```bash", command, "```", ""]
    rounds = 1 + max((run.repeat for run in runs), default=0)
    parts += [_TABLE_HEADER, *(_table_row(run, rounds) for run in runs), ""]
    ratios = median_ratio_rows(runs)
    if ratios:
        label = f" (median of {rounds} rounds)" if rounds > 1 else ""
        parts += [f"| rate | disaggregated | vs colocated | p99 ITL ratio{label} | median TTFT ratio{label} | "
                  f"out tok/s ratio{label} |", "|---:|---|---|---:|---:|---:|"]
        parts += [f"| {_rate(rate)} | {mode} | {base} | {statistics.median(itls):.2f}x | "
                  f"{statistics.median(ttfts):.2f}x | {statistics.median(tputs):.2f}x |"
                  for rate, mode, base, itls, ttfts, tputs in ratios]
        parts.append("")
    same = "same run" if rounds == 1 else f"{rounds} rounds, each mode once per round, ratios within a round"
    parts += [f"Goal (disaggregated vs {goal_baseline(runs) or 'colocated'}, {same}):", *goal_lines(runs), ""]
    parts += [devices_line(runs), ""]
    parts += multiturn_markdown(runs)
    parts.append("Latencies are measured at the HTTP client (vLLM's definitions); transfer = the server's "
                 "tandem_timing.transfer_ms (first byte -> ack; layer-streamed, mostly under the prefill), exposed "
                 "= transfer_exposed_ms (prefill step end -> ack: what the client waits for); KV pool whole = "
                 "free == total blocks on /metrics after the run.")
    return "\n".join(parts) + "\n"


def devices_line(runs: list[ModeRun]) -> str:
    """Whether the Ray modes ran on an equal device count (the GPUs column; CPU: rank shares of the cores)."""
    counts = {run.mode: run.devices for run in runs if run.devices}
    if not counts:
        return "GPUs: only the in-process engine ran (one GPU, or every core)."
    if len(set(counts.values())) == 1:
        return f"GPUs: every Ray mode used {next(iter(counts.values()))} (GPUs, one per rank; on CPU rank shares)."
    used = ", ".join(f"{mode} {count}" for mode, count in counts.items())
    return f"GPUs: NOT equal hardware, the modes used different device counts ({used})."


def runs_json(runs: list[ModeRun], flags: dict) -> dict:
    """{"flags": ..., "runs": [{"mode", "repeat", "request_rate", "pool_whole", **vLLM-style result keys}],
    "ratios": [{..., each ratio's median over the rounds, "rounds": each ratio per round}]}."""
    entries = []
    for run in runs:
        entry = {"mode": run.mode, "repeat": run.repeat, "hardware": run.hardware, "gpus": run.devices,
                 "pool_whole": run.pool_whole}
        entry.update(result_json(run.metrics, RunSettings(run.rate, flags.get("max_concurrency"),
                                                          flags.get("burstiness", 1.0))))
        entries.append(entry)
    finite = lambda value: value if math.isfinite(value) else None  # noqa: E731
    ratios = []
    for rate, mode, base, *columns in median_ratio_rows(runs):
        named = dict(zip(("p99_itl_ratio", "median_ttft_ratio", "output_throughput_ratio"), columns))
        ratios.append({"request_rate": _rate(rate), "mode": mode, "baseline": base,
                       **{name: finite(statistics.median(values)) for name, values in named.items()},
                       "rounds": {name: [finite(v) for v in values] for name, values in named.items()}})
    return {"flags": flags, "runs": entries, "ratios": ratios}
