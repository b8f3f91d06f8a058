"""StepTimeModel: how long one engine step takes, from what the step computes.

A step packs prefill chunks and decode rows into one forward (engine/core/scheduler.py). Its time is modelled
as a sum of non-negative terms, each the cost of one thing the step does:

    seconds = c0                                  fixed per step (Python, scheduling, small ops, sampling)
            + c1 * prefill_tokens                 the matmuls over the prompt rows
            + c2 * prefill_chunks                 one attention call (and a sampled row) per chunk
            + c3 * prefill_attention_pairs        query x key pairs of the prompt rows (causal, with the
                                                  chunk's earlier context)
            + c4 * decode_rows                    the matmuls, LM head and sampling of one-token rows
            + c5 * decode_context_tokens          the KV each decode row reads (paged attention)

The coefficients are fitted on measured steps (cluster/plan/profile.py) by non-negative least squares, so
the curve never falls when a step does more of anything (monotone by construction).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

OUTLIER_RATIO = 1.5
FEATURES = ("step", "prefill_tokens", "prefill_chunks", "prefill_attention_pairs", "decode_rows",
            "decode_context_tokens")


@dataclass(frozen=True)
class StepWork:
    """What one step computes: prefill chunks as (new tokens, tokens already computed before them) and the
    decode rows' context lengths (tokens each row attends to, itself included)."""

    prefill_chunks: tuple[tuple[int, int], ...] = ()
    decode_contexts: tuple[int, ...] = ()

    def features(self) -> tuple[float, ...]:
        """The step's values of FEATURES (the first, 1, is the fixed cost)."""
        tokens = sum(new for new, _ in self.prefill_chunks)
        # token i (0-based) of a chunk starting after `start` computed tokens attends to start + i + 1 keys
        pairs = sum(new * start + new * (new + 1) / 2 for new, start in self.prefill_chunks)
        return (1.0, float(tokens), float(len(self.prefill_chunks)), float(pairs),
                float(len(self.decode_contexts)), float(sum(self.decode_contexts)))

    @property
    def is_empty(self) -> bool:
        return not self.prefill_chunks and not self.decode_contexts


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per step as a non-negative combination of StepWork.features()."""

    coefficients: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES) or any(c < 0 or not np.isfinite(c) for c in self.coefficients):
            raise ValueError(f"a step model needs {len(FEATURES)} finite non-negative coefficients, "
                             f"got {self.coefficients}")

    def seconds(self, work: StepWork) -> float:
        """The predicted time of a step doing `work` (0 for a step doing nothing)."""
        if work.is_empty:
            return 0.0
        return float(sum(c * f for c, f in zip(self.coefficients, work.features())))

    def as_dict(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.coefficients))


def fit_step_model(works: list[StepWork], seconds: list[float]) -> StepTimeModel:
    """The StepTimeModel closest to the measured steps in relative terms (each step's error divided by
    its measured time, so short decode steps count as much as long prefill steps), with every coefficient
    >= 0. ValueError when there are no steps or a time is not positive. See fit_outliers for the steps left
    out of the fit."""
    return _fit(works, seconds, fit_outliers(works, seconds))


def fit_outliers(works: list[StepWork], seconds: list[float]) -> frozenset[int]:
    """The steps the fit leaves out: something else on the machine only ever slows a step down, so after a
    first fit the steps measured more than OUTLIER_RATIO x the fit are dropped (at most half of them) and the
    fit is repeated, up to three times. Indexes into `works`."""
    if not works or len(works) != len(seconds):
        raise ValueError("fitting a step model needs as many measured times as steps, at least one")
    if any(not s > 0 for s in seconds):
        raise ValueError("measured step times must be positive")
    dropped: frozenset[int] = frozenset()
    for _ in range(3):
        model = _fit(works, seconds, dropped)
        ratios = [s / max(model.seconds(w), 1e-12) for w, s in zip(works, seconds)]
        slow = sorted((i for i, r in enumerate(ratios) if r > OUTLIER_RATIO), key=lambda i: -ratios[i])
        now = frozenset(slow[:len(works) // 2])
        if now == dropped:
            break
        dropped = now
    return dropped


def _fit(works: list[StepWork], seconds: list[float], dropped: frozenset[int]) -> StepTimeModel:
    kept = [i for i in range(len(works)) if i not in dropped]
    measured = np.asarray([seconds[i] for i in kept], dtype=float)
    design = np.asarray([works[i].features() for i in kept], dtype=float) / measured[:, None]
    return StepTimeModel(tuple(float(c) for c in nonnegative_least_squares(design, np.ones(len(kept)))))


def nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin ||design @ x - target|| over x >= 0, exactly, by trying every subset of active columns (the
    problem here has six columns: 64 small least-squares solves). Columns that are all zero get 0."""
    columns = design.shape[1]
    best, best_residual = np.zeros(columns), float(np.sum(target ** 2))
    for size in range(1, columns + 1):
        for subset in itertools.combinations(range(columns), size):
            solution, *_ = np.linalg.lstsq(design[:, subset], target, rcond=None)
            if np.any(solution < 0):
                continue
            x = np.zeros(columns)
            x[list(subset)] = solution
            residual = float(np.sum((design @ x - target) ** 2))
            if residual < best_residual - 1e-15:
                best, best_residual = x, residual
    return best
