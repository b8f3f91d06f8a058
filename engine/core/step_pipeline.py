"""Launching and completing steps, with at most one step running on the device while the host works (async
scheduling, vLLM's async scheduler and SGLang's overlap scheduler in spirit).

A step is *launched* once its forward and sampling are issued and its picks are on their way to the host: its
sequences count their new tokens as computed and each sampled one holds a *pending* token (Sequence
.num_pending_tokens). It is *completed* once the picks are on the host: pending tokens become known ones, full
blocks are published to the prefix cache, forks take their share, and the engine appends the picks (stop checks,
detokenisation, deltas).

Without overlap, each step completes right after its launch. With it, LLMEngine.step launches step N + 1 and
then completes step N, so the host schedules, uploads and issues step N + 1 while the device still runs N, and
detokenises N while the device runs N + 1. The rows of step N + 1 whose last token is N's pick take it on the
device (engine/runner/step_batch.py). What lands a step late, and how nothing is emitted twice:
- a sequence whose pending token may be its last (max_tokens, the context limit) is not scheduled until the token
  is known (Scheduler._waits_for_host);
- a stop token or string, or an abort, found while the next step runs: that step's pick for the sequence is
  dropped at its completion (the sequence has finished); its KV write is to a block the step holds a reference on
  (`held_blocks`), so a block freed meanwhile cannot be handed to a KV transfer writing on another stream first;
- a step whose picks the host needs before the next step (grammars, penalties, min_tokens read the tokens so far;
  a prefill-only request's KV is handed off at its pick; an n > 1 prefill's samples fork at it) or a step with a
  layer observer (a prefill worker streaming KV) runs without overlap: it completes before the next is scheduled;
- preemption frees a running sequence's blocks as usual; a pending token still lands, and the sequence is
  admitted again only once it has (Scheduler._admit_waiting).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.core.fork import fork_samples
from engine.core.scheduler import Scheduler
from engine.core.step_observer import StepObserver
from engine.kv.kv_cache import KVCache
from engine.runner.model_runner import LaunchedStep, ModelRunner, StepResult
from engine.sequence import ScheduledChunk, Sequence


@dataclass(frozen=True)
class InFlightStep:
    """A launched step not completed yet."""

    launched: LaunchedStep
    chunks: tuple[ScheduledChunk, ...]
    held_blocks: tuple[int, ...]   # the blocks it writes, referenced until it completes (overlap only)
    started: float                 # when the engine step that launched it began (perf_counter)
    issued_at: float               # when its launch began (perf_counter)
    issue_s: float                 # host time to issue its forward and sampling
    needs_host: bool               # its picks must be on the host before the next step is scheduled
    device_events: tuple | None    # CUDA events around its launch's work on the stream (None off CUDA)


@dataclass(frozen=True)
class CompletedStep:
    """A completed step: the picks to append (sequence, token, logprobs), finished sequences' picks dropped."""

    step: InFlightStep
    picks: list[tuple[Sequence, int, object]]
    began: float        # the step's share of the timeline: from its call's start or the last completion, later one
    forward_s: float    # from its launch (or the last completion, the later) to its picks on the host
    device_s: float | None  # the device's time for its forward and sampling (CUDA events; None off CUDA)


class StepPipeline:
    """Owns the running step of one engine; see the module docstring. Not thread-safe (the engine's thread)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, kv_cache: KVCache, overlap: bool) -> None:
        self.runner, self.scheduler, self.kv_cache, self.overlap = runner, scheduler, kv_cache, overlap
        self.in_flight: InFlightStep | None = None
        self._last_completed_at = 0.0

    def launch(self, chunks: list[ScheduledChunk], observer: StepObserver | None, started: float) -> InFlightStep:
        """Issue the chunks' step, fed by the running one; the chunks' tokens count as computed and each sampled
        sequence that had a chunk holds a pending token from here on. The caller completes the returned step
        (after completing the running one, when it overlaps). observer: told which prefill-only requests the step
        completes and called per layer (LLMEngine.step); told forward_failed before an error propagates."""
        issued = time.perf_counter()
        events = _device_events(self.runner.device)
        on_layer = None
        if observer is not None:
            completing = [c.seq for c in chunks if c.samples and c.seq.prefill_only]
            on_layer = observer.forward_starting(completing) if completing else None
        try:
            launched = self.runner.launch(chunks, on_layer, self.in_flight.launched if self.in_flight else None)
        except BaseException as error:
            if on_layer is not None:
                observer.forward_failed(f"{type(error).__name__}: {error}")
            raise
        issue_s = time.perf_counter() - issued
        if events is not None:
            events[1].record()
        overlapping = self.overlap and observer is None
        held = tuple(_written_blocks(chunks, self.scheduler.block_size)) if overlapping else ()
        if held:
            self.kv_cache.allocator.share(held)
        for chunk in chunks:
            chunk.seq.num_computed_tokens += chunk.num_new_tokens
        scheduled = {id(chunk.seq) for chunk in chunks}  # a fork sampled beside its parent had no chunk
        for seq in launched.seqs:
            seq.num_pending_tokens += id(seq) in scheduled
        needs_host = not overlapping or any(_wanted_on_the_host(seq) for seq in launched.seqs)
        return InFlightStep(launched, tuple(chunks), held, started, issued, issue_s, needs_host, events)

    def settle_if_unwatched(self) -> None:
        """Complete the running step now when none of its picks is wanted any more (every sequence it samples has
        finished: aborted, stopped): nothing to append, its held blocks go back at once."""
        step = self.in_flight
        if step is not None and all(seq.is_finished for seq in step.launched.seqs):
            self.in_flight = None
            self.complete(step)

    def close(self) -> None:
        """Complete the running step, whose sequences have all finished (LLMEngine.close aborted them), and let go of
        the runner, the scheduler and the pool."""
        self.settle_if_unwatched()
        self.in_flight = None
        self.runner = self.scheduler = self.kv_cache = None

    def complete(self, step: InFlightStep) -> CompletedStep:
        """Wait for the step's picks and settle it: pending tokens become known (the caller appends them, in the
        order returned), the chunks' full blocks of known tokens are published, the samples of prefills that
        ended fork (as they stand before the picks are appended), held blocks are released."""
        result: StepResult = step.launched.result()
        for seq, entry in result.prompt_logprobs:
            seq.prompt_logprobs.append(entry)
        scheduled = {id(chunk.seq) for chunk in step.chunks}
        for seq in result.seqs:
            seq.num_pending_tokens -= id(seq) in scheduled
        for chunk in step.chunks:
            if not chunk.seq.is_finished and chunk.seq.block_table:
                self.scheduler.register_full_blocks(chunk.seq)
        for seq in result.seqs:
            if seq.forks and not seq.is_finished:  # a prefill of n samples just ended: they take its KV
                fork_samples(seq, self.scheduler, self.kv_cache)
        picks = [(seq, token, logprobs)
                 for seq, token, logprobs in zip(result.seqs, result.sampled.tokens, result.sampled.logprobs)
                 if not seq.is_finished]
        if step.held_blocks:
            self.kv_cache.allocator.free(step.held_blocks)
        ended, previous = time.perf_counter(), self._last_completed_at
        self._last_completed_at = ended
        device_s = _elapsed_s(step.device_events) if step.device_events else None
        return CompletedStep(step, picks, max(step.started, previous), ended - max(step.issued_at, previous),
                             device_s)


def _device_events(device) -> tuple | None:
    """A pair of timing events on CUDA, the first recorded now (the second once the step is issued)."""
    if device.type != "cuda":
        return None
    events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    events[0].record()
    return events


def _elapsed_s(events: tuple) -> float:
    events[1].synchronize()  # recorded after the work the picks' copy waited for: done, or about to be
    return events[0].elapsed_time(events[1]) / 1e3


def _wanted_on_the_host(seq: Sequence) -> bool:
    """A pick the host needs before the next step is scheduled: the next pick reads the tokens so far (a grammar,
    penalties, min_tokens), or it ends a prefill whose KV is handed off or whose samples fork."""
    return seq.grammar is not None or seq.params.penalized or seq.params.min_tokens > 0 or seq.prefill_only \
        or bool(seq.forks)


def _written_blocks(chunks: list[ScheduledChunk], block_size: int) -> list[int]:
    """The blocks the chunks' new K/V go to (computed before the step advances num_computed_tokens)."""
    blocks = []
    for chunk in chunks:
        first, last = chunk.seq.num_computed_tokens, chunk.seq.num_computed_tokens + chunk.num_new_tokens - 1
        blocks += chunk.seq.block_table[first // block_size:last // block_size + 1]
    return blocks
