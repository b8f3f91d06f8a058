"""The coordinator's side of the decode workers' channels: one DecodeEventPump per decode worker.

A decode worker's expect() calls and events travel on its direct channel (cluster/workers/decode_channel.py:
one TCP connection past Ray, whose actor calls and streaming items cost milliseconds on a busy host). The
worker emits its events into the actor's EventBatcher, which sends everything emitted since the last frame
as one list (in practice one list per engine step); the pump reads the frames and routes each event to the
mailbox of its request.

    actor side:        worker.expect(request, batcher.put) ... batcher.batches() -> frames
    coordinator side:  pump.open(request_id) -> asyncio.Queue; await pump.expect(request); pump.close(request_id)
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Awaitable, Callable

from cluster.workers.decode_channel import (ADMISSION, CALL_FAILED, EVENTS, EXPECT, ChannelAddress, read_frame,
                                            write_frame)
from decode_worker import Admission, ExpectedRequest

logger = logging.getLogger("tandem.cluster.decode_events")


class WorkerStreamLost(Exception):
    """Put in the mailboxes of a decode worker's requests (and raised by its expect() calls in flight) when
    its channel breaks. The worker is then lost whatever broke it: the coordinator kills it (its requests
    cannot be read any more) and they migrate; reading again could skip events that were in flight, while a
    migration resumes exactly where each client is."""

    def __init__(self, worker: str, error: BaseException) -> None:
        super().__init__(f"decode worker {worker}: {error}")
        self.worker, self.error = worker, error


class ChannelCallFailed(Exception):
    """A call on a decode worker's channel raised there (the worker and its channel stay up)."""


class DecodeEventPump:
    """Holds one decode worker's channel: sends its expect() calls and routes its events to per-request
    mailboxes.

    open() before expect(), so no event can arrive unrouted; close() when the request is over. Events of
    requests without a mailbox (already closed) are dropped. If the channel cannot be opened, breaks (the
    process died) or ends (the worker stopped) while requests are open, every open mailbox gets a
    WorkerStreamLost, every expect() in flight raises it, and `on_lost(worker, error)` is called once.
    open_channel: asks the worker where its channel listens (DecodeActor.open_channel)."""

    def __init__(self, worker: str, open_channel: Callable[[], Awaitable[ChannelAddress]],
                 on_lost: Callable[[str, BaseException], None]) -> None:
        self.worker = worker
        self._mailboxes: dict[str, asyncio.Queue] = {}
        self._answers: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._on_lost = on_lost
        self._lost: WorkerStreamLost | None = None
        self._loop = asyncio.get_running_loop()
        self._connected = asyncio.Event()
        self._writer: asyncio.StreamWriter | None = None
        self._task = self._loop.create_task(self._run(open_channel))

    def on_running_loop(self) -> bool:
        """Whether this pump reads on the caller's event loop (a pump of a closed loop reads nothing)."""
        return self._loop is asyncio.get_running_loop()

    def open(self, request_id: str) -> asyncio.Queue:
        """A new mailbox for `request_id`; it holds WorkerStreamLost at once if the channel is gone."""
        mailbox: asyncio.Queue = asyncio.Queue()
        if self._lost is not None:
            mailbox.put_nowait(self._lost)
        self._mailboxes[request_id] = mailbox
        return mailbox

    def close(self, request_id: str) -> None:
        self._mailboxes.pop(request_id, None)

    async def expect(self, request: ExpectedRequest) -> Admission:
        """The worker's Admission for `request` (its events then come to the request's mailbox);
        WorkerStreamLost if the channel is or goes down first."""
        await self._connected.wait()
        if self._lost is not None:
            raise self._lost
        call_id = next(self._call_ids)
        answer = self._answers[call_id] = self._loop.create_future()
        try:
            write_frame(self._writer, (EXPECT, call_id, request))
            return await answer
        finally:
            self._answers.pop(call_id, None)

    async def _run(self, open_channel: Callable[[], Awaitable[ChannelAddress]]) -> None:
        try:
            address = await open_channel()
            reader, self._writer = await asyncio.open_connection(address.host, address.port)
            self._writer.write(address.secret)
            self._connected.set()
            await self._read(reader)
            error: BaseException = RuntimeError("its event stream ended")
        except asyncio.CancelledError:
            if self._writer is not None:
                self._writer.close()
            raise
        except Exception as caught:  # noqa: BLE001 - any break ends this worker's channel
            error = caught
        self._lose(error)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        """Routes frames until the channel ends (EOF); raises if it breaks."""
        while True:
            try:
                kind, call_id, body = await read_frame(reader)
            except asyncio.IncompleteReadError:
                return
            if kind == EVENTS:
                for event in body:
                    mailbox = self._mailboxes.get(event.request_id)
                    if mailbox is not None:
                        mailbox.put_nowait(event)
            elif kind in (ADMISSION, CALL_FAILED):
                answer = self._answers.get(call_id)
                if answer is not None and not answer.done():
                    if kind == ADMISSION:
                        answer.set_result(body)
                    else:
                        answer.set_exception(ChannelCallFailed(f"decode worker {self.worker}: {body}"))

    def _lose(self, error: BaseException) -> None:
        self._lost = WorkerStreamLost(self.worker, error)
        if self._writer is not None:
            self._writer.close()
        self._connected.set()
        for answer in self._answers.values():
            if not answer.done():
                answer.set_exception(self._lost)
        for mailbox in self._mailboxes.values():
            mailbox.put_nowait(self._lost)
        self._on_lost(self.worker, error)

    def stop(self) -> None:
        """Stop reading and close the channel (coordinator shutdown); open mailboxes get nothing more."""
        if not self._loop.is_closed():
            self._task.cancel()
