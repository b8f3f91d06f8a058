"""StepLog: the engine's last steps, one record each (what a step held and what it cost), and their summary.

Where serving loses time is in what the steps hold: a decode waits for every prompt token of the steps between
two of its tokens, and for the gaps between steps (the caller's work: delivering tokens, taking requests). The
log keeps the last `capacity` steps; `summary()` is the line `tandem serve` prints when it stops, and what
`tandem bench peer` reads beside the client's latencies.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from engine.sequence import ScheduledChunk

DEFAULT_CAPACITY = 16384


@dataclass(frozen=True)
class StepRecord:
    """One step: when it started (time.perf_counter), its forward's and its whole call's seconds, and its tokens
    (prompt: chunks of a prompt; decode: single tokens after a computed context) and prompts (chunks of prompts).
    With async scheduling a step's share of the timeline starts where the step before it completed (the two
    overlap on the device). issue_s: the host's time to issue its forward and sampling; device_s: the device's time
    for them (CUDA events; None elsewhere)."""

    started_at: float
    forward_s: float
    step_s: float
    prompt_tokens: int
    decode_tokens: int
    prompts: int
    issue_s: float = 0.0
    device_s: float | None = None


class StepLog:
    """The last `capacity` StepRecords (the engine's thread appends; read them from the same thread or after)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._records: deque[StepRecord] = deque(maxlen=capacity)

    def record(self, record: StepRecord) -> None:
        self._records.append(record)

    def records(self) -> list[StepRecord]:
        return list(self._records)

    def last(self) -> StepRecord | None:
        """The newest record (None before the first step), without copying the log."""
        return self._records[-1] if self._records else None

    def summary(self) -> str:
        """One line: steps and busy share; decode-only steps (ms, batch); steps with prompts (ms, prompt tokens,
        and the most prompt tokens a step that also carried decodes held); the gaps between steps."""
        records = self.records()
        if not records:
            return "engine steps: none"
        span = records[-1].started_at + records[-1].step_s - records[0].started_at
        decode_only = [r for r in records if not r.prompt_tokens]
        with_prompts = [r for r in records if r.prompt_tokens]
        mixed = [r.prompt_tokens for r in with_prompts if r.decode_tokens]
        gaps = [later.started_at - (earlier.started_at + earlier.step_s) for earlier, later in zip(records, records[1:])]
        parts = [f"engine steps: {len(records)} over {span:.1f} s, busy {sum(r.step_s for r in records) / span:.0%}"]
        if decode_only:
            parts.append(f"decode-only {len(decode_only)}: {_ms(decode_only)}, batch "
                         f"{statistics.mean(r.decode_tokens for r in decode_only):.1f} mean")
        if with_prompts:
            parts.append(f"with prompts {len(with_prompts)}: {_ms(with_prompts)}, prompt tokens p50 "
                         f"{statistics.median(r.prompt_tokens for r in with_prompts):.0f} max "
                         f"{max(r.prompt_tokens for r in with_prompts)}; with decodes too {len(mixed)}"
                         + (f", prompt tokens max {max(mixed)}" if mixed else ""))
        if gaps:
            parts.append(f"gaps between steps p50 {statistics.median(gaps) * 1e3:.1f} ms p99 "
                         f"{_percentile(gaps, 0.99) * 1e3:.1f} ms")
        return "; ".join(parts)


def chunk_tokens(chunks: list[ScheduledChunk]) -> tuple[int, int, int]:
    """(prompt tokens, decode tokens, prompts) of a step's chunks, counted once their tokens are computed (as
    EngineStats counts them: a chunk that started past the prompt is a decode)."""
    prompt_tokens = decode_tokens = prompts = 0
    for chunk in chunks:
        if chunk.seq.num_computed_tokens - chunk.num_new_tokens >= chunk.seq.num_prompt_tokens:
            decode_tokens += chunk.num_new_tokens
        else:
            prompt_tokens += chunk.num_new_tokens
            prompts += 1
    return prompt_tokens, decode_tokens, prompts


def _ms(records: list[StepRecord]) -> str:
    seconds = [r.step_s for r in records]
    return f"p50 {statistics.median(seconds) * 1e3:.1f} ms p99 {_percentile(seconds, 0.99) * 1e3:.1f} ms"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
