"""A decode worker's direct channel to the coordinator: one TCP connection that carries expect() calls one way
and the worker's event batches the other, past Ray.

A Ray actor call or streaming item costs the two processes about half a millisecond of CPU each and, on a
busy host, milliseconds of latency (measured: an expect() reached the decode actor 2.5-3.3 ms after the
coordinator sent it, on 2 shared cores); a frame on a socket the two keep open costs a syscall each way.
Ray still starts, watches and stops the actor; the channel carries only the hot path.

    coordinator                                     decode actor (this module's ChannelServer)
    open_channel.remote() over Ray        ----->    listens on the node's address, port 0; returns
                                                     (host, port, secret)
    connect, send the secret              ----->    compares it (nothing is read before it matches)
    (EXPECT, call id, ExpectedRequest)    ----->    worker.expect(...)
                                          <-----    (ADMISSION, call id, Admission), or
                                                    (CALL_FAILED, call id, what expect() raised)
                                          <-----    (EVENTS, [DecodeChunk | DecodeEnded, ...])  per step

Frames are a 4-byte big-endian length and a pickle (the same objects Ray would pickle); the secret travels
only over Ray, so only the coordinator that asked can send. The connection ends when the worker stops (its
event batches end) or the coordinator closes it; a coordinator that connects again takes the events over
(EventBatcher: one consumer at a time).
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import pickle
import secrets
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable

from cluster.workers.event_batcher import EventBatcher
from decode_worker import Admission, ExpectedRequest

logger = logging.getLogger("tandem.cluster.workers.decode_channel")
EXPECT, ADMISSION, CALL_FAILED, EVENTS = "expect", "admission", "call_failed", "events"
SECRET_BYTES = 32
SECRET_TIMEOUT_S = 10.0  # a connection that has not sent the secret by then is closed
MAX_FRAME_BYTES = 1 << 30
_LENGTH = struct.Struct(">I")


@dataclass(frozen=True)
class ChannelAddress:
    """Where a decode worker's channel listens, and the secret a connection opens with."""

    host: str
    port: int
    secret: bytes


def write_frame(writer: asyncio.StreamWriter, message: Any) -> None:
    """Queue one frame on `writer` (the caller drains)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_LENGTH.pack(len(payload)) + payload)


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's message; asyncio.IncompleteReadError at the end of the stream."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"a channel frame of {length} bytes is over {MAX_FRAME_BYTES}")
    return pickle.loads(await reader.readexactly(length))


class ChannelServer:
    """Serves a decode worker's channel on the event loop start() runs on (the actor's default group's,
    where `expect` runs), and holds the EventBatcher the worker's events go into."""

    def __init__(self, expect: Callable[[ExpectedRequest, Callable], Admission],
                 secret_timeout_s: float = SECRET_TIMEOUT_S) -> None:
        """expect(request, emit): the worker's (DecodeWorker.expect); emit is this channel's batcher's put.
        A connection that has not shown the secret within secret_timeout_s is dropped. `drops` counts the
        connections dropped before anything past the secret was read, by reason."""
        self._expect, self._secret_timeout_s = expect, secret_timeout_s
        self.drops: collections.Counter[str] = collections.Counter()
        self._secret = secrets.token_bytes(SECRET_BYTES)
        self._lock = threading.Lock()  # close() may run on another thread than start()
        self._closed = False
        self._server: asyncio.Server | None = None
        self._batcher: EventBatcher | None = None

    async def start(self, host: str) -> ChannelAddress:
        """Listen on `host` (a free port), once; the address to connect to. After close() a connection
        ends at once."""
        with self._lock:
            if self._batcher is None:
                self._batcher = EventBatcher(asyncio.get_running_loop())
                if self._closed:
                    self._batcher.close()
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        return ChannelAddress(host, port, self._secret)

    def close(self) -> None:
        """The events end after what is pending (the connection then ends) and nothing new is accepted.
        Any thread; call it once the worker emits nothing more."""
        with self._lock:
            self._closed = True
            batcher = self._batcher
        if batcher is not None:
            batcher.close()  # thread-safe: wakes the sender on the channel's loop
            batcher.call_soon(self._close_server)

    def _close_server(self) -> None:
        """On the channel's loop: no new connections (if start() is still making its listener, that one stays,
        and every connection to it ends at once, as after close())."""
        if self._server is not None:
            self._server.close()

    async def _authenticated(self, reader: asyncio.StreamReader) -> bool:
        """Reads the secret (nothing else); False, counted and logged, when it is not this channel's."""
        try:
            secret = await asyncio.wait_for(reader.readexactly(SECRET_BYTES), self._secret_timeout_s)
        except asyncio.TimeoutError:
            reason = "timeout"
        except (asyncio.IncompleteReadError, ConnectionError):
            reason = "closed"
        else:
            if hmac.compare_digest(secret, self._secret):
                return True
            reason = "unauthenticated"
        self.drops[reason] += 1
        logger.warning("a channel connection was dropped before its secret matched (%s)", reason)
        return False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if not await self._authenticated(reader):
                return
            events = asyncio.create_task(self._send_events(writer))
            try:
                await self._answer_calls(reader, writer)
            finally:
                events.cancel()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the coordinator closed it
        except Exception:  # noqa: BLE001 - a broken peer ends its connection, not the worker
            logger.exception("a channel connection failed and was closed")
        finally:
            writer.close()

    async def _answer_calls(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        emit = self._batcher.put
        while True:
            kind, call_id, request = await read_frame(reader)
            if kind != EXPECT:
                raise ValueError(f"unknown channel call {kind!r}")
            try:
                write_frame(writer, (ADMISSION, call_id, self._expect(request, emit)))
            except Exception as error:  # noqa: BLE001 - the call fails, the channel stays
                logger.exception("expect(%s) failed", getattr(request, "request_id", "?"))
                write_frame(writer, (CALL_FAILED, call_id, f"{type(error).__name__}: {error}"))
            await writer.drain()

    async def _send_events(self, writer: asyncio.StreamWriter) -> None:
        """Every event batch to the coordinator; the stream ends (EOF) when the batcher closes (stop)."""
        try:
            async for batch in self._batcher.batches():
                write_frame(writer, (EVENTS, None, batch))
                await writer.drain()
        except ConnectionError:
            return
        writer.close()
