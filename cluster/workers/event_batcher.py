"""The decode actor's side of its events: EventBatcher.

Every event the worker emits (from the step thread) goes into one EventBatcher, and the actor's channel
(cluster/workers/decode_channel.py) sends everything emitted since the last frame as one list (in practice
one list per engine step), so the per-message cost is paid per step, not per token. The coordinator reads
the frames with a DecodeEventPump (cluster/coordinator/decode_events.py).
"""
from __future__ import annotations

import asyncio
import threading
from typing import Callable

from decode_worker import DecodeEvent


class EventBatcher:
    """Collects events from any thread; batches() yields them in order, grouped, on `loop`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[DecodeEvent] = []
        self._closed = False
        self._consumers = 0  # batches() calls so far; only the latest one consumes
        self._wakeup = asyncio.Event()

    def put(self, event: DecodeEvent) -> None:
        """Queue one event (never blocks); the first of a batch wakes the consumer."""
        with self._lock:
            self._pending.append(event)
            first = len(self._pending) == 1
        if first:
            self._loop.call_soon_threadsafe(self._wakeup.set)

    def call_soon(self, callback: Callable[[], object]) -> None:
        """Runs `callback` on the batcher's loop (any thread), unless that loop is closed."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(callback)

    def close(self) -> None:
        """batches() ends after yielding what is still pending."""
        with self._lock:
            self._closed = True
        self._loop.call_soon_threadsafe(self._wakeup.set)

    async def batches(self):
        """Async iterator of non-empty lists of events, each list everything put since the last one.
        One consumer at a time: a new batches() call takes over and the previous one ends (a
        coordinator that moved to a new event loop subscribes again)."""
        self._consumers += 1
        me = self._consumers
        self._wakeup.set()  # a previous consumer wakes, sees it was replaced, and leaves
        while True:
            await self._wakeup.wait()
            if self._consumers != me:
                return
            self._wakeup.clear()
            with self._lock:
                batch, self._pending, closed = self._pending, [], self._closed
            if batch:
                yield batch
            if closed:
                return
