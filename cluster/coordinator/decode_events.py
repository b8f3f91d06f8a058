"""The coordinator's side of the decode event streams: one DecodeEventPump per decode worker.

A Ray streaming-generator item costs about half a millisecond of CPU on each side; a stream per request
would pay that for every token of every request, which on a busy decode worker (tens of requests, a
token each per step) eats whole cores. Instead the decode actor batches: every event its worker emits
goes into an EventBatcher, and the actor's single `events()` stream yields everything emitted since the
last item as one list (in practice: one list per engine step). On the coordinator side a
DecodeEventPump reads that stream and routes each event to the mailbox of its request.

    actor side (cluster/workers/event_batcher.py):  batcher.put(event) -> async for batch in batcher.batches()
    coordinator side (here):  pump.open(request_id) -> asyncio.Queue ... pump.close(request_id)
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from ray.exceptions import RayActorError

logger = logging.getLogger("tandem.cluster.decode_events")


class WorkerStreamLost(Exception):
    """Put in the mailboxes of a decode worker's requests when its event stream breaks. The worker is
    then lost whatever broke the stream: the coordinator kills it (its requests cannot be read any
    more) and they migrate; re-reading a broken stream could skip events that were in flight, while a
    migration resumes exactly where each client is."""

    def __init__(self, worker: str, error: BaseException) -> None:
        super().__init__(f"decode worker {worker}: {error}")
        self.worker, self.error = worker, error


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
