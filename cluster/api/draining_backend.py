"""DrainingBackend: a Backend that can stop taking work and end what is in flight, for a clean stop.

`tandem serve` puts one in front of its backend. On SIGTERM/SIGINT it calls, in order:

    backend.begin_stop()                 # new requests: BackendUnavailable("the server is stopping")
    await backend.drain(grace_s)         # requests in flight may finish, for up to grace_s
    await backend.end_in_flight()        # the others end with BackendUnavailable("the server is stopping")
    ... stop the front ends, then await backend.shutdown()

BackendUnavailable is what the front ends already answer as gRPC UNAVAILABLE, HTTP 503, or an SSE error
event mid-stream, so every client in flight sees an answer that says the server is stopping rather than a
dropped connection. Each request's chunks are read from the wrapped backend by a task of its own into a
queue, so that end_in_flight() can end a request that is waiting for its next chunk: the reader is
cancelled, which closes the wrapped stream (the request is aborted and its blocks freed, as on a client
cancel), and the consumer gets the error after the chunks it already had.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing

from cluster.backend import Backend, BackendHealth, BackendUnavailable, GenerationChunk, GenerationRequest

STOPPING = "the server is stopping"
_END = object()


class DrainingBackend:
    """Delegates to `backend`; see the module docstring. Use from one asyncio loop."""

    def __init__(self, backend: Backend) -> None:
        self.model_name = backend.model_name
        self.max_model_len = backend.max_model_len
        self._backend = backend
        self._stopping = False
        self._in_flight: dict[asyncio.Task, asyncio.Queue] = {}  # reader task -> its request's queue
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def tokenizer(self):
        return self._backend.tokenizer

    @property
    def in_flight(self) -> int:
        """Requests whose stream is open."""
        return len(self._in_flight)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """The wrapped backend's chunks and errors, unchanged, until end_in_flight(); BackendUnavailable
        once begin_stop() was called. Closing it early aborts the request (its reader is cancelled and
        awaited)."""
        if self._stopping:
            raise BackendUnavailable(STOPPING)
        chunks: asyncio.Queue = asyncio.Queue()
        reader = asyncio.ensure_future(self._read(request, chunks))
        self._in_flight[reader] = chunks
        self._idle.clear()
        try:
            while (item := await chunks.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            del self._in_flight[reader]
            if not self._in_flight:
                self._idle.set()

    async def _read(self, request: GenerationRequest, chunks: asyncio.Queue) -> None:
        try:
            async with aclosing(self._backend.generate(request)) as stream:
                async for chunk in stream:
                    chunks.put_nowait(chunk)
            chunks.put_nowait(_END)
        except Exception as error:  # handed to the consumer, which raises it
            chunks.put_nowait(error)

    def begin_stop(self) -> None:
        """From now on generate() refuses new requests and health() says not serving."""
        self._stopping = True

    async def drain(self, grace_s: float) -> int:
        """Wait until no request is in flight, or grace_s passed; returns how many still are."""
        if self._in_flight:
            try:
                await asyncio.wait_for(self._idle.wait(), grace_s)
            except asyncio.TimeoutError:
                pass
        return len(self._in_flight)

    async def end_in_flight(self, timeout_s: float = 5.0) -> None:
        """Ends every request in flight: its wrapped stream is closed (the request aborted, its blocks
        freed) and its consumer gets BackendUnavailable("the server is stopping") after the chunks it
        already had. Waits (up to timeout_s) until the consumers closed their streams."""
        self.begin_stop()
        for reader, chunks in list(self._in_flight.items()):
            if not reader.done():
                reader.cancel()
                chunks.put_nowait(BackendUnavailable(STOPPING))
        await self.drain(timeout_s)

    async def health(self) -> BackendHealth:
        """The wrapped backend's health; not serving once stopping."""
        health = await self._backend.health()
        return dataclasses.replace(health, serving=False) if self._stopping else health

    async def shutdown(self) -> None:
        """Ends what is still in flight (at once), then shuts the wrapped backend down."""
        await self.end_in_flight(timeout_s=1.0)
        await self._backend.shutdown()
