"""The results of `tandem bench peer`: one row per server and rate, each Tandem row's ratios to the peer at the
same rate (below 1.0x is better for the latencies, above for throughput), the JSON, and one bar chart."""
from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

import numpy as np

from cluster.bench.serve_metrics import BenchmarkMetrics, RequestResult
from cluster.bench.serve_report import RunSettings, result_json

PEER_NAMES = ("vllm", "peer")
PLOTTED = (("TTFT p50", lambda m: m.ttft.median), ("TPOT p50", lambda m: m.tpot.median),
           ("ITL p99", lambda m: m.itl.p99))


@dataclasses.dataclass(frozen=True)
class PeerRun:
    """One server at one request rate (in one round of --repeats): its metrics, or None with the error when it
    could not run."""

    server: str
    rate: float
    metrics: BenchmarkMetrics | None
    results: list[RequestResult]
    error: str = ""
    round: int = 0  # --repeats: every server once per round; ratios pair the runs of one round

    @property
    def usable(self) -> bool:
        """Whether there are figures to report: the server ran and answered at least one request."""
        return self.metrics is not None and self.metrics.completed > 0

    def summary_line(self) -> str:
        if not self.usable:
            return f"no figures: {self.error or self._first_failure()}"
        m = self.metrics
        return (f"{m.completed} ok, {m.failed} failed, {m.output_throughput:.1f} out tok/s, TTFT p50 "
                f"{m.ttft.median:.0f} ms, TPOT p50 {m.tpot.median:.1f} ms, ITL p99 {m.itl.p99:.0f} ms")

    def _first_failure(self) -> str:
        errors = [r.error for r in self.results if not r.success]
        return f"all {len(errors)} requests failed, e.g. {errors[0]}" if errors else "no requests"


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _peer_at(runs: list[PeerRun], rate: float, round_: int) -> PeerRun | None:
    return next((r for r in runs if r.server in PEER_NAMES and r.rate == rate and r.round == round_ and r.usable),
                None)


def _name(run: PeerRun, rounds: int) -> str:
    return run.server if rounds == 1 else f"{run.server} #{run.round + 1}"


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs > 0 else "-"


RATIO_METRICS = (("TTFT p50", lambda m: m.ttft.median), ("TPOT p50", lambda m: m.tpot.median),
                 ("ITL p99", lambda m: m.itl.p99), ("out tok/s", lambda m: m.output_throughput))


def round_ratios(runs: list[PeerRun]) -> dict[tuple[str, float], list[tuple[float, ...]]]:
    """Per Tandem server and rate, its ratios to the peer (RATIO_METRICS' order) in each round both ran, in round
    order: a ratio pairs two runs of one round, never runs of two rounds."""
    ratios: dict[tuple[str, float], list[tuple[float, ...]]] = {}
    for run in runs:
        peer = _peer_at(runs, run.rate, run.round)
        if run.server in PEER_NAMES or not run.usable or peer is None:
            continue
        pairs = [(value(run.metrics), value(peer.metrics)) for _, value in RATIO_METRICS]
        if all(theirs > 0 for _, theirs in pairs):
            ratios.setdefault((run.server, run.rate), []).append(tuple(ours / theirs for ours, theirs in pairs))
    return ratios


def _across_rounds(runs: list[PeerRun]) -> list[str]:
    """With several rounds: each Tandem server's median ratio per rate and metric, every round's beside it (on a
    machine whose speed drifts between the servers' turns, one round's ratio can be off by a factor of two)."""
    rows = [(key, per_round) for key, per_round in round_ratios(runs).items() if len(per_round) > 1]
    if not rows:
        return []
    lines = ["", "Across rounds, the median of each round's ratio (every round's in brackets):", "",
             "| server | rate | " + " | ".join(f"{name} vs peer" for name, _ in RATIO_METRICS) + " |",
             "|---|---:|" + "---:|" * len(RATIO_METRICS)]
    for (server, rate), per_round in rows:
        cells = [f"{statistics.median(column):.2f}x ({', '.join(f'{r:.2f}' for r in column)})"
                 for column in zip(*per_round)]
        lines.append(f"| {server} | {_rate(rate)} | " + " | ".join(cells) + " |")
    return lines


def format_markdown(runs: list[PeerRun], command: str = "") -> str:
    lines = [f"`{command}`\n" if command else "",
             "| server | rate | ok / failed | TTFT p50 / p99 ms | TPOT p50 ms | ITL p99 ms | out tok/s | "
             "vs peer: TTFT p50 | TPOT p50 | ITL p99 | out tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rounds = 1 + max((run.round for run in runs), default=0)
    for run in runs:
        if not run.usable:
            lines.append(f"| {_name(run, rounds)} | {_rate(run.rate)} | no figures: {run.summary_line()[12:]} "
                         "| | | | | | | | |")
            continue
        m, peer = run.metrics, _peer_at(runs, run.rate, run.round)
        ratios = "- | - | - | -"
        if peer is not None and run is not peer:
            ratios = " | ".join(_ratio(value(m), value(peer.metrics)) for _, value in RATIO_METRICS)
        lines.append(f"| {_name(run, rounds)} | {_rate(run.rate)} | {m.completed} / {m.failed} | {m.ttft.median:.0f} / "
                     f"{m.ttft.p99:.0f} | {m.tpot.median:.1f} | {m.itl.p99:.0f} | {m.output_throughput:.1f} | "
                     f"{ratios} |")
    lines = [line for line in lines if line] + _across_rounds(runs)
    return "\n".join(lines) + "\n"


def runs_json(runs: list[PeerRun], max_concurrency: int | None, burstiness: float) -> list[dict]:
    """Each run's server, rate and error, with vLLM's result keys (serve_report.result_json) when it ran."""
    return [{"server": r.server, "rate": r.rate, "round": r.round, "error": r.error or None,
             "metrics": result_json(r.metrics, RunSettings(r.rate, max_concurrency, burstiness)) if r.usable else None}
            for r in runs]


def write_plot(runs: list[PeerRun], path: Path) -> Path | None:
    """peer.png: one panel per plotted metric, bars per server grouped by rate (the first round); None when nothing
    ran."""
    usable = [run for run in runs if run.usable and run.round == 0]  # the first round's
    if not usable:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = sorted({run.rate for run in usable})
    servers = list(dict.fromkeys(run.server for run in usable))
    figure, axes = plt.subplots(1, len(PLOTTED), figsize=(5.5 * len(PLOTTED), 4.2), squeeze=False)
    width = 0.8 / len(servers)
    for axis, (label, value_of) in zip(axes[0], PLOTTED):
        for index, server in enumerate(servers):
            values = [next((value_of(r.metrics) for r in usable if r.server == server and r.rate == rate), 0.0)
                      for rate in rates]  # [rates] ms
            axis.bar(np.arange(len(rates)) + index * width, values, width, label=server)
        axis.set_xticks(np.arange(len(rates)) + width * (len(servers) - 1) / 2, [f"{_rate(r)} req/s" for r in rates])
        axis.set(ylabel="ms", title=label)
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
