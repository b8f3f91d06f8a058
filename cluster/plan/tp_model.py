"""How long a tensor-parallel group's step takes, from the TP=1 profile and the cost of the group's collectives.

A TP group of T ranks splits every matmul and the attention heads T ways and all-reduces the activations twice
per layer (and once for the embedding), gathering the logits where it samples (engine/parallel/). The planner
models a group's step from the profiled TP=1 step (cluster/plan/step_model.py, one device) as

    seconds_T(work) = c0 + (seconds_1(work) - c0) / T + step_s + token_s x rows

c0 is the profile's fixed cost per step (Python, scheduling, sampling: every rank pays it in parallel, rank 0
schedules), the rest is compute divided among the ranks, and `step_s + token_s x rows` (rows: the prefill
tokens and decode rows of the step) is what the collectives add, a TpCost per TP size, from one of:

    given      `tandem plan --tp-cost T:STEP_MS:TOKEN_US` (e.g. from `tandem bench tp --tp T` on the serving
               machine: its decode and prefill steps against TP=1's; `T:0:0` is the ideal, collectives for free)
    measured   by default, for every TP size > 1 the deployments use: a TP=1 and a TP=T engine of the model are
               built here as `tandem bench tp` builds them (cluster/bench/tensor_parallel.py: one --cpu-threads
               share per rank), a decode step (MEASURE_BATCH rows) and a prefill step (MEASURE_PREFILL tokens)
               timed on each (medians of MEASURE_ROUNDS alternating rounds), and the two numbers are the line
               through the two steps' excess over the formula's compute part. NCCL needs T GPUs on this machine.
    loaded     a profile saved with --save-profile keeps the costs it used (`tp_costs`)

KV memory: a decode group of B ranks holds B times the KV of one device; the simulation does not model the
pool (cluster/plan/engine_sim.py), so this changes nothing there. The KV transfer moves the same bytes whatever
the layouts (each decode rank receives the heads it owns); the planner charges them at the measured
bandwidth of one link (cluster/plan/transfer_model.py): parallel per-rank links would be faster.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from types import SimpleNamespace

from cluster.plan.step_model import StepTimeModel, StepWork

MEASURE_BATCH, MEASURE_CONTEXT, MEASURE_PREFILL, MEASURE_ROUNDS, MEASURE_STEPS = 8, 128, 512, 3, 8


@dataclass(frozen=True)
class TpCost:
    """What a TP group of `tp` ranks' collectives add to a step: `step_s` per step and `token_s` per row;
    `source` says where the numbers came from (shown in the report)."""

    tp: int
    step_s: float
    token_s: float
    source: str = "given"

    def __post_init__(self) -> None:
        if self.tp < 2 or not self.step_s >= 0 or not self.token_s >= 0:
            raise ValueError(f"a TP cost needs a TP size >= 2 and costs >= 0, got {self}")

    def as_dict(self) -> dict:
        return {"tp": self.tp, "step_ms": self.step_s * 1e3, "token_us": self.token_s * 1e6, "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> "TpCost":
        return cls(int(data["tp"]), float(data["step_ms"]) / 1e3, float(data["token_us"]) / 1e6,
                   str(data.get("source", "loaded")))


@dataclass(frozen=True)
class TpStepModel:
    """A TP group's step time (the module docstring's formula); with tp 1 exactly the base model's."""

    base: StepTimeModel
    tp: int = 1
    cost: TpCost | None = None

    def __post_init__(self) -> None:
        if self.tp < 1 or (self.tp > 1) != (self.cost is not None) or (self.cost and self.cost.tp != self.tp):
            raise ValueError(f"a TP step model of {self.tp} rank(s) needs the TpCost of that size (none at TP=1)")

    def seconds(self, work: StepWork) -> float:
        """The predicted time of the group's step doing `work` (0 for a step doing nothing)."""
        single = self.base.seconds(work)
        if self.cost is None or work.is_empty:
            return single
        fixed = min(self.base.coefficients[0], single)
        rows = sum(new for new, _ in work.prefill_chunks) + len(work.decode_contexts)
        return fixed + (single - fixed) / self.tp + self.cost.step_s + self.cost.token_s * rows


def parse_tp_cost(text: str) -> TpCost:
    """'2:0.3:1.5' (TP size : ms per step : us per row) -> TpCost; ValueError naming --tp-cost."""
    parts = text.split(":")
    try:
        if len(parts) != 3:
            raise ValueError("three fields")
        return TpCost(int(parts[0]), float(parts[1]) / 1e3, float(parts[2]) / 1e6, f"given: --tp-cost {text}")
    except ValueError:
        raise ValueError(f"--tp-cost {text!r}: give T:STEP_MS:TOKEN_US with T >= 2 and costs >= 0 "
                         "(e.g. 2:0.3:1.5)") from None


def fit_tp_cost(tp: int, base: StepTimeModel, points: list[tuple[StepWork, float]], source: str) -> TpCost:
    """The TpCost whose line goes through the excess of two measured group steps (work, seconds) over the
    formula's compute part; each cost clamped at 0 (a step measured faster than the ideal adds nothing)."""
    ideal = TpStepModel(base, tp, TpCost(tp, 0.0, 0.0))
    (few, few_s), (many, many_s) = sorted(points, key=lambda point: _rows(point[0]))
    excess_few, excess_many = few_s - ideal.seconds(few), many_s - ideal.seconds(many)
    token_s = max(0.0, (excess_many - excess_few) / max(_rows(many) - _rows(few), 1))
    return TpCost(tp, max(0.0, excess_few - token_s * _rows(few)), token_s, source)


def _rows(work: StepWork) -> int:
    return sum(new for new, _ in work.prefill_chunks) + len(work.decode_contexts)


def measure_tp_cost(tp: int, base: StepTimeModel, model: str | None, dtype: str, device: str,
                    threads: int) -> TpCost:
    """Times a decode and a prefill step on a TP=`tp` engine of `model` (the module docstring's 'measured') and
    fits its TpCost against `base`. Restores torch's thread count. RuntimeError when the engine cannot be built
    here (say which flag gives the numbers instead)."""
    import torch

    from cluster.bench import tensor_parallel as bench
    from engine import LLM

    options = dict(device=device, dtype=dtype, max_num_seqs=MEASURE_BATCH + 1, kv_cache_memory=128 << 20,
                   max_num_batched_tokens=max(2048, MEASURE_PREFILL), tensor_parallel_size=tp)
    args = SimpleNamespace(rounds=MEASURE_ROUNDS, batch=MEASURE_BATCH, context=MEASURE_CONTEXT,
                           steps=MEASURE_STEPS, prefill_tokens=MEASURE_PREFILL)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads * tp)  # the leader divides them among the ranks: `threads` each
    try:
        with LLM(model, **options) as llm:
            decode, prefill = bench.measure({"group": (llm, threads)}, args)["group"]
    except Exception as error:  # noqa: BLE001: any failure to start a group means: not measurable here
        raise RuntimeError(f"measuring a TP={tp} step on {device} failed ({type(error).__name__}: {error}); give "
                           f"--tp-cost {tp}:STEP_MS:TOKEN_US instead (e.g. from `tandem bench tp --tp {tp}`)") from None
    finally:
        torch.set_num_threads(saved)
    points = [(StepWork((), (MEASURE_CONTEXT + 1,) * MEASURE_BATCH), statistics.median(decode) / 1e3),
              (StepWork(((MEASURE_PREFILL, 0),)), statistics.median(prefill) / 1e3)]
    cost = fit_tp_cost(tp, base, points, "")
    return TpCost(tp, cost.step_s, cost.token_s,
                  f"measured: a TP={tp} engine's decode ({MEASURE_BATCH} rows) and prefill ({MEASURE_PREFILL} "
                  f"tokens) steps on {device}, {threads} thread(s) per rank")


def group_model(base: StepTimeModel, tp: int, costs: tuple[TpCost, ...]) -> TpStepModel:
    """The step model of a worker of `tp` ranks: `base` at TP=1, else with the TpCost of that size in `costs`.
    ValueError when there is none (`tandem plan` measures or takes one for every TP size it plans)."""
    if tp == 1:
        return TpStepModel(base)
    cost = next((c for c in costs if c.tp == tp), None)
    if cost is None:
        raise ValueError(f"no cost of TP={tp}'s collectives to scale its steps with: "
                         f"give --tp-cost {tp}:STEP_MS:TOKEN_US")
    return TpStepModel(base, tp, cost)
