"""WaitingRequests: a decode worker's accepted requests whose KV has not been admitted yet, their deadlines,
and the cancels that arrived before their expect.

A waiting request has no deadline until its transfer starts (it waits for its prefill as long as the
coordinator keeps it); from then on it has expect_timeout_s for its KV to land. Ray may run an actor's
cancel() before the expect() it follows: such a cancel is remembered for expect_timeout_s, so that the late
expect ends at once instead of waiting for KV. Used by the step thread only.
"""
from __future__ import annotations

import dataclasses

from decode_worker.commands import Waiting
from decode_worker.messages import EmitEvent, ExpectedRequest


class WaitingRequests:
    def __init__(self, expect_timeout_s: float) -> None:
        self._timeout_s = expect_timeout_s
        self._waiting: dict[str, Waiting] = {}
        self._early_cancels: dict[str, float] = {}  # request id -> when the memory of its cancel lapses

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def add(self, request: ExpectedRequest, emit: EmitEvent) -> None:
        self._waiting[request.request_id] = Waiting(request, emit)

    def pop(self, request_id: str) -> Waiting | None:
        """The request leaves the waiting set (its KV landed or failed, or it ended); None if not waiting."""
        return self._waiting.pop(request_id, None)

    def cancelled_early(self, request_id: str) -> bool:
        """Whether a cancel for `request_id` came before its expect (forgotten once asked)."""
        return self._early_cancels.pop(request_id, None) is not None

    def remember_cancel(self, request_id: str, now: float) -> None:
        """A cancel for a request not (yet) expected: a later expect of it ends at once."""
        self._early_cancels[request_id] = now + self._timeout_s

    def start_deadline(self, request_id: str, now: float) -> None:
        """Its transfer started: its KV must land within expect_timeout_s (once; later calls change nothing)."""
        waiting = self._waiting.get(request_id)
        if waiting is not None and waiting.deadline is None:
            self._waiting[request_id] = dataclasses.replace(waiting, deadline=now + self._timeout_s)

    def next_deadline(self) -> float | None:
        return min((w.deadline for w in self._waiting.values() if w.deadline is not None), default=None)

    def expire(self, now: float) -> list[tuple[str, Waiting]]:
        """Takes out the requests whose deadline passed (and forgets lapsed early cancels)."""
        for request_id in [rid for rid, until in self._early_cancels.items() if until <= now]:
            del self._early_cancels[request_id]
        expired = [rid for rid, w in self._waiting.items() if w.deadline is not None and w.deadline <= now]
        return [(rid, self._waiting.pop(rid)) for rid in expired]

    def take_all(self) -> list[tuple[str, Waiting]]:
        """Every waiting request, taken out (the worker stops)."""
        taken, self._waiting = list(self._waiting.items()), {}
        return taken
