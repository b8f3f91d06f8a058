"""PNG plots of a `tandem bench compare` run (matplotlib, Agg backend: no display needed).

ttft_cdf.png        TTFT CDF per mode, one panel per request rate
itl_cdf.png         ITL CDF per mode (log x: the prefill stalls are the long tail), one panel per rate
ttft_breakdown.png  mean TTFT per mode and rate, stacked: queue, prefill, KV transfer, the rest (first
                    token to the client: decode admission, streaming); means add up, medians would not
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from cluster.bench.compare_report import ModeRun

_STAGES = (("queue_ms", "queue"), ("prefill_ms", "prefill"), ("transfer_exposed_ms", "KV transfer (exposed)"))


def require_matplotlib() -> None:
    """ValueError with the install hint when matplotlib is missing (checked before a long run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("tandem bench compare draws its plots with matplotlib: "
                         "pip install 'tandem[bench]' (or pip install matplotlib)") from None


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _rate_label(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:g} req/s"


def _cdf_figure(runs: list[ModeRun], values_of, xlabel: str, title: str, path: Path, log_x: bool) -> Path:
    plt = _pyplot()
    rates = sorted({run.rate for run in runs})
    figure, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.2), squeeze=False)
    for axis, rate in zip(axes[0], rates):
        for run in (r for r in runs if r.rate == rate):
            values = np.sort(np.asarray(values_of(run), dtype=float) * 1000)  # [n] ms
            if values.size:
                axis.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=run.mode)
        axis.set(xlabel=xlabel, ylabel="fraction of samples", title=f"{title} @ {_rate_label(rate)}")
        if log_x:
            axis.set_xscale("log")
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _breakdown_figure(runs: list[ModeRun], path: Path) -> Path:
    plt = _pyplot()
    labels = [_bar_label(run) for run in runs]
    bottoms = np.zeros(len(runs))  # [num_runs] ms stacked so far
    figure, axis = plt.subplots(figsize=(max(6.0, 1.6 * len(runs)), 4.5))
    for key, name in _STAGES:
        heights = np.array([_mean_stage(run, key) for run in runs])
        axis.bar(labels, heights, bottom=bottoms, label=name)
        bottoms += heights
    ttft = np.array([run.metrics.ttft.mean for run in runs])
    axis.bar(labels, np.clip(ttft - bottoms, 0.0, None), bottom=bottoms, label="rest (to the client)")
    axis.set(ylabel="mean TTFT (ms)", title="TTFT breakdown (server stamps; client-measured total)")
    axis.tick_params(axis="x", labelsize=8)
    axis.legend()
    axis.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _bar_label(run: ModeRun) -> str:
    """Mode and rate on short lines ("disagg-1p1d / local256 / 8 req/s"), so neighbours do not overlap."""
    mode = run.mode.replace("-local", "\nlocal")
    return f"{mode}\n{_rate_label(run.rate)}"


def _mean_stage(run: ModeRun, key: str) -> float:
    values = [float(r.timing.get(key, 0.0)) for r in run.results if r.success and r.timing]
    return float(np.mean(values)) if values else 0.0


def write_plots(runs: list[ModeRun], results_dir: Path) -> list[Path]:
    """Writes the three PNGs into results_dir and returns their paths."""
    done = lambda run: [r for r in run.results if r.success and r.chunk_times]  # noqa: E731
    return [
        _cdf_figure(runs, lambda run: [r.ttft for r in done(run)], "TTFT (ms)", "TTFT CDF",
                    results_dir / "ttft_cdf.png", log_x=False),
        _cdf_figure(runs, lambda run: [gap for r in done(run) for gap in r.itls], "ITL (ms, log)", "ITL CDF",
                    results_dir / "itl_cdf.png", log_x=True),
        _breakdown_figure(runs, results_dir / "ttft_breakdown.png"),
    ]
