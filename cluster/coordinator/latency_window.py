"""LatencyWindow: the coordinator's own TTFT, inter-token and queue latencies over a recent window.

    window = LatencyWindow()
    clock = window.request(request.arrival_time)      # per request, in Coordinator.generate
    ... yield clock.delivered(chunk) ...               # records TTFT, the gaps between chunks, the queue time
    window.summary(time.perf_counter(), 30.0, 5)       # p90s over the last 30 s (None below 5 samples)

What the autoscaler reads (cluster/coordinator/autoscaler.py): measured where the client's stream is
handed to the front end, as the Timing is, so a migration's gap counts as the client sees it. Samples are
perf_counter seconds; at most max_samples of each kind are kept (the oldest go first). Asyncio loop only.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from cluster.backend import GenerationChunk


@dataclass(frozen=True)
class LatencySummary:
    """90th percentiles over the window in ms (None where fewer than min_samples were seen) and counts."""

    ttft_p90_ms: float | None
    itl_p90_ms: float | None
    queue_p90_ms: float | None
    requests: int          # first tokens seen in the window


class LatencyWindow:
    def __init__(self, max_samples: int = 50_000) -> None:
        if max_samples < 1:
            raise ValueError("max_samples must be >= 1")
        self._ttft: deque[tuple[float, float]] = deque(maxlen=max_samples)   # (when, seconds)
        self._itl: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._queue: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def request(self, arrival_time: float) -> RequestClock:
        """The clock of one request that arrived at `arrival_time` (perf_counter)."""
        return RequestClock(self, arrival_time)

    def record(self, kind: str, seconds: float, now: float) -> None:
        """One sample of `kind` ("ttft", "itl" or "queue")."""
        {"ttft": self._ttft, "itl": self._itl, "queue": self._queue}[kind].append((now, seconds))

    def summary(self, now: float, window_s: float, min_samples: int = 1) -> LatencySummary:
        """The p90 of each kind over (now - window_s, now], None for a kind with fewer than min_samples
        samples there; drops older samples."""
        since = now - window_s
        for samples in (self._ttft, self._itl, self._queue):
            while samples and samples[0][0] <= since:
                samples.popleft()
        return LatencySummary(*(_p90(samples, min_samples) for samples in (self._ttft, self._itl, self._queue)),
                              len(self._ttft))


class RequestClock:
    """Records one request's latencies as its chunks pass (see LatencyWindow)."""

    def __init__(self, window: LatencyWindow, arrival_time: float) -> None:
        self._window, self._arrival = window, arrival_time
        self._previous: float | None = None

    def delivered(self, chunk: GenerationChunk) -> GenerationChunk:
        """Records the chunk (the first token's TTFT, else the gap per token since the previous chunk, and
        the queue time the final chunk's Timing carries) and returns it unchanged."""
        now = time.perf_counter()
        if chunk.token_ids:
            if self._previous is None:
                self._window.record("ttft", now - self._arrival, now)
            else:
                self._window.record("itl", (now - self._previous) / len(chunk.token_ids), now)
            self._previous = now
        if chunk.timing is not None:
            self._window.record("queue", chunk.timing.queue_ms / 1e3, now)
        return chunk


def _p90(samples: deque, min_samples: int) -> float | None:
    """The 90th percentile (nearest rank) of the samples' seconds, in ms."""
    if len(samples) < min_samples:
        return None
    ordered = sorted(seconds for _, seconds in samples)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1e3
