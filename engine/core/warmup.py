"""Warm-up at engine start: every kind of step the engine will serve runs once, so no request pays for a compile.

Issue 27, item 5: the first request after `tandem serve` started spent 827 ms in prefill that the tenth did not.
The kernels no longer compile per step (per-step integers are runtime values: engine/attention/triton_*.py), but
each kernel still compiles once per variant, and the prefill kernel autotunes its tile on its first launch. So
`warm_up(engine)` drives the engine through its public API with dummy requests, one phase after the other:

- prefill: a prompt of twice the step's token budget (capped by max_model_len): a pure prefill step of the whole
  budget (what the memory plan also profiled), then a chunk over a cached prefix, then decode steps over the
  long context (flash-decoding partitions on a GPU);
- mixed: a few short prompts (one a seeded top-k/top-p sample: the sampler's other path), and once they decode
  a prompt of the budget, so that a step carries decodes and a prompt chunk together;
- the decode sizes: the captured decode graphs (engine/runner/decode_graphs.py) already ran and captured every
  batch size of their ladder when the engine started; eager decode steps of any size share one compiled kernel.

Afterwards the engine looks untouched: no live request, every block free, an empty prefix cache (the dummy
prompts' blocks forgotten), fresh stats and step log. It uses only the engine's public calls:
`engine` is any LLMEngine. Also here: `triton_cache_dir`, the Triton cache directory of one worker.
"""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from engine.sampling_params import SamplingParams

logger = logging.getLogger("tandem.engine")
REQUEST_PREFIX = "__warmup-"
MIXED_DECODES = 4  # short prompts decoding beside the mixed phase's prompt
MIXED_MAX_TOKENS = 8


@dataclass(frozen=True)
class WarmupReport:
    """What warm_up ran: its wall time, its steps by kind (prompt tokens only, prompt tokens beside decodes,
    decodes only), the longest context it reached, the decode batch sizes the engine's captured graphs
    cover (() without graphs) and the token counts of its captured prefill and mixed steps (() without)."""

    seconds: float
    prefill_steps: int
    mixed_steps: int
    decode_steps: int
    longest_context: int
    graph_sizes: tuple[int, ...]
    mixed_graph_sizes: tuple[int, ...] = ()

    @property
    def steps(self) -> int:
        return self.prefill_steps + self.mixed_steps + self.decode_steps

    def describe(self) -> str:
        graphs = f"decode graphs {list(self.graph_sizes)} captured at start" if self.graph_sizes else "no decode graphs"
        if self.mixed_graph_sizes:
            graphs += f", prefill and mixed steps of up to {self.mixed_graph_sizes[-1]} tokens piecewise"
        return (f"warm-up {self.seconds:.2f} s: {self.steps} steps ({self.prefill_steps} prefill, {self.mixed_steps} "
                f"mixed, {self.decode_steps} decode), contexts up to {self.longest_context} tokens; {graphs}")


def warm_up(engine) -> WarmupReport:
    """Run the engine's step variants with dummy requests (see the module docstring), then reset what they left.

    Needs an engine with no live request (ValueError otherwise): call it right after the engine is built. Changes
    nothing a caller can see afterwards: no live request, every KV block free, the prefix cache empty (also of
    anything cached before the call), engine.stats and engine.step_log new and empty, the scheduler's preemption
    count 0. Logs and returns a WarmupReport."""
    if engine.num_live_requests or engine.has_unfinished_requests():
        raise ValueError("warm_up needs an engine with no live request: call it when the engine starts")
    started = time.perf_counter()
    longest = _prefill_phase(engine)
    _mixed_phase(engine)
    kinds = _step_kinds(engine.step_log.records())
    _reset(engine)
    graphs, mixed = engine.runner.decode_graphs, engine.runner.mixed_graphs
    report = WarmupReport(time.perf_counter() - started, *kinds, longest, tuple(graphs.sizes) if graphs else (),
                          mixed.captured_sizes if mixed else ())
    logger.info("%s", report.describe())
    return report


def _budget(engine) -> int:
    return engine.config.max_num_batched_tokens


def _prompt(engine, index: int, length: int) -> list[int]:
    """A dummy prompt of token 0s whose first token differs from request to request: no two share a cached block."""
    return [index % engine.model_config.vocab_size] + [0] * (length - 1)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _prefill_phase(engine) -> int:
    """One prompt of two step budgets (at most max_model_len - 2 tokens) and two tokens after it: a pure prefill
    step, a chunk over a cached prefix, decodes over a long context. Returns the context it reached."""
    length = max(1, min(engine.max_model_len - 2, 2 * _budget(engine)))
    engine.add_request(f"{REQUEST_PREFIX}long", _prompt(engine, 0, length), _greedy(2))
    _run_until_done(engine)
    return length + 2


def _mixed_phase(engine) -> None:
    """Short prompts until every one decodes, then a prompt of one step budget beside their decodes."""
    decodes = min(MIXED_DECODES, engine.config.max_num_seqs - 1)
    if decodes < 1:  # one sequence per step: there is no mixed step to warm
        return
    short = min(engine.config.block_size + 1, engine.max_model_len - MIXED_MAX_TOKENS)
    if short < 1:
        return
    ids = [f"{REQUEST_PREFIX}short-{i}" for i in range(decodes)]
    for i, request_id in enumerate(ids):
        params = _greedy(MIXED_MAX_TOKENS) if i else SamplingParams(
            max_tokens=MIXED_MAX_TOKENS, temperature=0.8, top_k=20, top_p=0.9, seed=0, ignore_eos=True)
        engine.add_request(request_id, _prompt(engine, 1 + i, short), params)
    started = set()
    while len(started) < decodes and engine.has_unfinished_requests():
        started.update(delta.request_id for delta in engine.step())
    length = max(1, min(engine.max_model_len - 2, _budget(engine)))
    engine.add_request(f"{REQUEST_PREFIX}mixed", _prompt(engine, 1 + decodes, length), _greedy(2))
    _run_until_done(engine)


def _run_until_done(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _step_kinds(records) -> tuple[int, int, int]:
    """(prompt tokens only, prompt tokens and decodes, decodes only) steps among the step log's records."""
    prefill = sum(1 for r in records if r.prompt_tokens and not r.decode_tokens)
    mixed = sum(1 for r in records if r.prompt_tokens and r.decode_tokens)
    return prefill, mixed, sum(1 for r in records if not r.prompt_tokens)


def _reset(engine) -> None:
    """Forget what the dummy requests left: cached prefixes, counters, the step log. RuntimeError if any of them
    is still live or holds a block (a bug: warm-up must leave the pool as it found it)."""
    allocator = engine.kv_cache.allocator
    if engine.num_live_requests or allocator.num_free_blocks != engine.kv_cache.num_blocks:
        raise RuntimeError(f"warm-up left {engine.num_live_requests} requests and "
                           f"{engine.kv_cache.num_blocks - allocator.num_free_blocks} blocks behind")
    allocator.reset_prefix_cache()
    engine.stats = type(engine.stats)()
    engine.step_log = type(engine.step_log)()
    engine.scheduler.num_preemptions = 0


def triton_cache_dir(worker_name: str, root: str | os.PathLike | None = None) -> Path:
    """The Triton cache directory of one worker, created if missing: <root>/<worker_name> (the name made safe for a
    path). root: TANDEM_TRITON_CACHE_ROOT when set, else Triton's own cache under TRITON_HOME (~ by default)
    /.triton/cache/tandem. A worker that keeps its name across restarts finds its kernels (and the prefill
    kernel's autotuned tiles) compiled. Set it as TRITON_CACHE_DIR before the first compile (use_triton_cache_dir)."""
    if root is None:
        home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
        root = os.environ.get("TANDEM_TRITON_CACHE_ROOT") or os.path.join(home, ".triton", "cache", "tandem")
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", worker_name).strip("._")
    if not safe:
        raise ValueError(f"worker name {worker_name!r} has nothing usable in a directory name")
    path = Path(root) / safe
    path.mkdir(parents=True, exist_ok=True)
    return path


def use_triton_cache_dir(worker_name: str, root: str | os.PathLike | None = None) -> Path:
    """Points this process's Triton cache (TRITON_CACHE_DIR, read by Triton at each compile) at
    triton_cache_dir(worker_name, root) and returns it. Call it in the worker's process before its engine is built."""
    path = triton_cache_dir(worker_name, root)
    os.environ["TRITON_CACHE_DIR"] = str(path)
    return path
