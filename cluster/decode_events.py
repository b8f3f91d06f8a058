"""One event stream per decode worker instead of one per request.

A Ray streaming-generator item costs about half a millisecond of CPU on each side; a stream per request
would pay that for every token of every request, which on a busy decode worker (tens of requests, a
token each per step) eats whole cores. Instead the decode actor batches: every event its worker emits
goes into an EventBatcher, and the actor's single `events()` stream yields everything emitted since the
last item as one list (in practice: one list per engine step). On the coordinator side a
DecodeEventPump reads that stream and routes each event to the mailbox of its request.

    actor side:        batcher.put(event)  (any thread)   ->   async for batch in batcher.batches()
    coordinator side:  pump.open(request_id) -> asyncio.Queue ... pump.close(request_id)
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

from ray.exceptions import RayActorError

from decode_worker import DecodeEvent

logger = logging.getLogger("tandem.cluster.decode_events")


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


class WorkerStreamLost(Exception):
    """Put in the mailboxes of a decode worker's requests when its event stream breaks."""

    def __init__(self, worker: str, error: BaseException) -> None:
        super().__init__(f"decode worker {worker}: {error}")
        self.worker, self.error = worker, error

    @property
    def died(self) -> bool:
        """The actor died (the stream broke with RayActorError), rather than failing otherwise."""
        return isinstance(self.error, RayActorError)


class DecodeEventPump:
    """Reads one decode worker's event stream and routes events to per-request mailboxes.

    open() before asking the worker to expect a request, so no event can arrive unrouted; close() when
    the request is over. Events of requests without a mailbox (already closed) are dropped. If the
    stream breaks (the actor died) or ends while requests are open, every open mailbox gets a
    WorkerStreamLost and `on_lost(worker, error)` is called once."""

    def __init__(self, worker: str, stream, on_lost: Callable[[str, BaseException], None]) -> None:
        self.worker = worker
        self._mailboxes: dict[str, asyncio.Queue] = {}
        self._on_lost = on_lost
        self._lost: WorkerStreamLost | None = None
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(stream))

    def on_running_loop(self) -> bool:
        """Whether this pump reads on the caller's event loop (a pump of a closed loop reads nothing)."""
        return self._loop is asyncio.get_running_loop()

    def open(self, request_id: str) -> asyncio.Queue:
        """A new mailbox for `request_id`; it holds WorkerStreamLost at once if the stream is gone."""
        mailbox: asyncio.Queue = asyncio.Queue()
        if self._lost is not None:
            mailbox.put_nowait(self._lost)
        self._mailboxes[request_id] = mailbox
        return mailbox

    def close(self, request_id: str) -> None:
        self._mailboxes.pop(request_id, None)

    async def _run(self, stream) -> None:
        try:
            async for ref in stream:
                for event in await ref:
                    mailbox = self._mailboxes.get(event.request_id)
                    if mailbox is not None:
                        mailbox.put_nowait(event)
            error: BaseException = RuntimeError("its event stream ended")
        except asyncio.CancelledError:
            raise
        except (RayActorError, Exception) as caught:  # noqa: BLE001 - any break ends this worker's stream
            error = caught
        self._lost = WorkerStreamLost(self.worker, error)
        for mailbox in self._mailboxes.values():
            mailbox.put_nowait(self._lost)
        self._on_lost(self.worker, error)

    def stop(self) -> None:
        """Stop reading (coordinator shutdown); open mailboxes get nothing more."""
        if not self._loop.is_closed():
            self._task.cancel()
