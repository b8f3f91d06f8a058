"""Profiling one prefill worker's and one decode worker's engine for real, step by step.

Each engine is built as a worker actor builds it (cluster/workers/actors.py: `torch.set_num_threads` to the
worker's share on CPU, then `build_engine` with the worker's EngineConfig) in this process: a CPU worker's
engine runs in its actor's process the same way. Then, on a small grid:

    prefill worker  packed prompts (count x length) through its chunked prefill: tokens/s against the tokens
                    of a step, and long prompts' later chunks against their growing context
    decode worker   B requests admitted with `add_prefilled_request` at context C (the KV a transfer would
                    have written; its values do not change the time), then decode steps: step time against
                    batch size and context; and decode rows sharing steps with a prompt's chunks (what a
                    colocated replica runs)

Every step is timed around `LLMEngine.step()` (wall clock, the host waits for the device's tokens), and what
it computed is read from the engine's sequences before and after it (StepWork). The fitted StepTimeModel
turns any step the simulation schedules into seconds.
"""
from __future__ import annotations

import gc
import random
import sys
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from cluster.plan.host_model import ServingCosts
from cluster.plan.step_model import StepTimeModel, StepWork, fit_outliers, fit_step_model
from cluster.plan.tp_model import TpCost
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProfileGrid:
    """prefill: (prompts, length) submitted together; decode: every batch x context, `decode_steps` steps each;
    mixed: (decode rows, their context, prompt length). Each prefill point runs `repeats` times."""

    prefill: tuple[tuple[int, int], ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    mixed: tuple[tuple[int, int, int], ...]
    decode_steps: int = 4
    repeats: int = 2

    @property
    def num_points(self) -> int:
        return (len(self.prefill) * self.repeats + len(self.decode_batches) * len(self.decode_contexts)
                + len(self.mixed))


GRIDS = {
    "full": ProfileGrid(prefill=((1, 16), (1, 64), (4, 64), (16, 64), (32, 64), (1, 256), (2, 256), (4, 256),
                                 (8, 256), (1, 1024), (1, 4096)),
                        decode_batches=(1, 4, 16, 64, 128), decode_contexts=(64, 512, 1536),
                        mixed=((4, 256, 512), (32, 256, 512), (64, 512, 1024))),
    "quick": ProfileGrid(prefill=((1, 16), (2, 64), (1, 200)), decode_batches=(1, 8), decode_contexts=(32, 128),
                         mixed=((4, 64, 128),), decode_steps=2, repeats=1),
}


@dataclass(frozen=True)
class MeasuredStep:
    phase: str          # "prefill", "decode" or "mixed"
    point: str          # the grid point, e.g. "8x256" (prefill), "16x512" (decode), "4x256+512" (mixed)
    work: StepWork
    seconds: float


@dataclass(frozen=True)
class EngineProfile:
    """What was measured and on what: the planner's only input about the hardware besides the transfer.
    `serving`: the serving path's costs per kind of deployment ("colocated", "disaggregated"), once
    `tandem plan --calibrate` has measured them. `tp_costs`: what TP groups' collectives cost (tp_model.py), as
    measured or given when the profile was saved."""

    model: str
    device: str
    dtype: str
    cpu_threads: int
    max_model_len: int
    block_size: int
    bytes_per_block: int
    steps: tuple[MeasuredStep, ...] = field(repr=False)
    serving: dict[str, ServingCosts] = field(default_factory=dict, repr=False, compare=False)
    tp_costs: tuple[TpCost, ...] = field(default=(), repr=False, compare=False)

    def fit(self) -> StepTimeModel:
        return fit_step_model([s.work for s in self.steps], [s.seconds for s in self.steps])

    def outliers(self) -> frozenset[int]:
        """The steps the fit leaves out (step_model.fit_outliers): measured while something else ran."""
        return fit_outliers([s.work for s in self.steps], [s.seconds for s in self.steps])

    def as_dict(self) -> dict:
        head = {k: getattr(self, k) for k in ("model", "device", "dtype", "cpu_threads", "max_model_len",
                                              "block_size", "bytes_per_block")}
        steps = [{"phase": s.phase, "point": s.point, "prefill_chunks": [list(c) for c in s.work.prefill_chunks],
                  "decode_contexts": list(s.work.decode_contexts), "seconds": s.seconds} for s in self.steps]
        serving = {kind: costs.as_dict() for kind, costs in self.serving.items()}
        tp = {"tp_costs": [cost.as_dict() for cost in self.tp_costs]} if self.tp_costs else {}
        return {**head, "steps": steps, **({"serving": serving} if serving else {}), **tp}

    @classmethod
    def from_dict(cls, data: dict) -> "EngineProfile":
        """The inverse of as_dict; ValueError when `data` is not a saved profile."""
        try:
            steps = tuple(MeasuredStep(s["phase"], s["point"], _work(s), float(s["seconds"])) for s in data["steps"])
            serving = {str(kind): ServingCosts.from_dict(costs) for kind, costs in data.get("serving", {}).items()}
            tp_costs = tuple(TpCost.from_dict(cost) for cost in data.get("tp_costs", ()))
            return cls(str(data["model"]), str(data["device"]), str(data["dtype"]), int(data["cpu_threads"]),
                       int(data["max_model_len"]), int(data["block_size"]), int(data["bytes_per_block"]), steps,
                       serving, tp_costs)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"not a saved `tandem plan` profile ({type(error).__name__}: {error})") from None


def _work(step: dict) -> StepWork:
    chunks = tuple((int(new), int(start)) for new, start in step["prefill_chunks"])
    return StepWork(chunks, tuple(int(context) for context in step["decode_contexts"]))


@dataclass(frozen=True)
class WorkerEngines:
    """How to build the two engines: the model, dtype, device, torch threads, and each role's EngineConfig."""

    model: str | None
    dtype: str
    device: str
    cpu_threads: int
    prefill_config: EngineConfig
    decode_config: EngineConfig


def profile_workers(engines: WorkerEngines, grid: ProfileGrid, show_progress: bool | None = None) -> EngineProfile:
    """Builds the prefill worker's engine, measures the grid's prefill steps, releases it, then the same for
    the decode worker's engine with the decode and mixed steps. Restores torch's thread count."""
    import torch

    bar = tqdm(total=grid.num_points, desc="profile", unit="point",
               disable=not sys.stderr.isatty() if show_progress is None else not show_progress)
    threads = torch.get_num_threads()
    torch.set_num_threads(engines.cpu_threads)
    try:
        steps, _ = _profile_engine(engines, engines.prefill_config, [measure_prefill], grid, bar)
        decode_steps, description = _profile_engine(engines, engines.decode_config, [measure_decode, measure_mixed],
                                                    grid, bar)
    finally:
        torch.set_num_threads(threads)
        bar.close()
    return EngineProfile(*description, tuple(steps + decode_steps))


def _profile_engine(engines: WorkerEngines, config: EngineConfig, measurements, grid: ProfileGrid, bar):
    """(the steps `measurements` measure on an engine built with `config`, what the engine is). The engine is
    gone when this returns (its memory back to the device before the next one is built)."""
    from engine.builder import build_engine
    engine = build_engine(engines.model, config, dtype=engines.dtype, device=engines.device)
    try:
        warm_up(engine)
        steps = [step for measure in measurements for step in measure(engine, grid, bar)]
        if engine.num_live_requests or engine.num_free_blocks != engine.num_total_blocks:
            raise RuntimeError(f"the profile left {engine.num_live_requests} requests and "
                               f"{engine.num_total_blocks - engine.num_free_blocks} KV blocks in its engine")
        spec = engine.kv_cache.spec
        description = (engines.model or "embedded default", str(engine.device),
                       str(engine.dtype).removeprefix("torch."), engines.cpu_threads, engine.max_model_len,
                       spec.block_size, spec.bytes_per_block)
    finally:
        del engine
        gc.collect()
        _empty_device_cache()
    return steps, description


def _empty_device_cache() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _advance(bar) -> None:
    if bar is not None:
        bar.update(1)


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _prompt(engine, length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(engine.model_config.vocab_size) for _ in range(length)]


def warm_up(engine) -> None:
    """One short prefill and a few decode steps, unmeasured (first calls allocate and pack)."""
    engine.add_request("plan-warmup", _prompt(engine, min(32, engine.max_model_len - 4), random.Random(7)), _params(3))
    while engine.has_unfinished_requests():
        engine.step()


def measure_prefill(engine, grid: ProfileGrid, bar=None) -> list[MeasuredStep]:
    """Every (count, length) prompts submitted at once with max_tokens 1, stepped until done: each step
    measured. Lengths are capped by the engine's max_model_len; fresh tokens each time (no cache hits)."""
    steps, rng = [], random.Random(11)
    for repeat in range(grid.repeats):
        for count, length in grid.prefill:
            length = min(length, engine.max_model_len - 1)
            ids = [f"plan-prefill-{repeat}-{count}x{length}-{i}" for i in range(count)]
            for request_id in ids:
                engine.add_request(request_id, _prompt(engine, length, rng), _params(1))
            while engine.has_unfinished_requests():
                steps.append(measure_step(engine, ids, "prefill", f"{count}x{length}"))
            _advance(bar)
    return steps


def _admit_decodes(engine, batch: int, context: int, max_tokens: int, tag: str, rng: random.Random) -> list[str] | None:
    """`batch` requests of `context` prompt tokens admitted as a decode worker admits transferred KV; None
    (nothing admitted) when the pool cannot hold them for max_tokens more tokens."""
    block = engine.config.block_size
    per_request = -(-(context + max_tokens) // block)
    if context + max_tokens > engine.max_model_len or batch * per_request > engine.num_free_blocks \
            or batch > engine.config.max_num_seqs:
        return None
    ids = []
    for i in range(batch):
        blocks = engine.reserve_blocks(-(-context // block))
        ids.append(f"plan-decode-{tag}-{i}")
        first_token = rng.randrange(engine.model_config.vocab_size)
        engine.add_prefilled_request(ids[-1], _prompt(engine, context, rng), first_token, _params(max_tokens), blocks)
    return ids


def measure_decode(engine, grid: ProfileGrid, bar=None) -> list[MeasuredStep]:
    steps, rng = [], random.Random(13)
    for batch in grid.decode_batches:
        for context in grid.decode_contexts:
            ids = _admit_decodes(engine, batch, context, grid.decode_steps + 2, f"{batch}x{context}", rng)
            if ids is not None:
                steps += [measure_step(engine, ids, "decode", f"{batch}x{context}") for _ in range(grid.decode_steps)]
                for request_id in ids:
                    engine.abort(request_id)
            _advance(bar)
    return steps


def measure_mixed(engine, grid: ProfileGrid, bar=None) -> list[MeasuredStep]:
    """Decode rows beside a prompt's prefill chunks, until the prompt is done."""
    steps, rng = [], random.Random(17)
    for batch, context, length in grid.mixed:
        length = min(length, engine.max_model_len - 1)
        ids = _admit_decodes(engine, batch, context, 64 + length // 16, f"mixed-{batch}x{context}", rng)
        if ids is not None:
            prompt_id = f"plan-mixed-prompt-{batch}x{length}"
            engine.add_request(prompt_id, _prompt(engine, length, rng), _params(1))
            while engine.get_sequence(prompt_id) is not None:
                steps.append(measure_step(engine, [*ids, prompt_id], "mixed", f"{batch}x{context}+{length}"))
            for request_id in ids:
                engine.abort(request_id)
        _advance(bar)
    return steps


def measure_step(engine, request_ids: list[str], phase: str = "", point: str = "") -> MeasuredStep:
    """One `engine.step()`, timed, and what it computed for `request_ids` (read from their sequences)."""
    before = {}
    for request_id in request_ids:
        seq = engine.get_sequence(request_id)
        if seq is not None and not seq.is_finished:
            before[request_id] = (seq.num_computed_tokens, seq.num_prompt_tokens, seq.num_tokens)
    started = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - started
    prefill, decode = [], []
    for request_id, (computed, prompt, total) in before.items():
        seq = engine.get_sequence(request_id)
        new = (seq.num_computed_tokens if seq is not None and not seq.is_finished else total) - computed
        if new == 1 and computed >= prompt:
            decode.append(computed + 1)
        elif new > 0:
            prefill.append((new, computed))
    return MeasuredStep(phase, point, StepWork(tuple(prefill), tuple(decode)), seconds)
