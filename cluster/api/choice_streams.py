"""ChoiceStreams: the backend streams of one OpenAI request, run concurrently and merged into one stream of
choices.

A completion request with a batch of prompts is one GenerationRequest per prompt; a request with n > 1 asks
its backend for n samples of its prompt, which come back as chunks with `index` 0..n-1. OpenAI numbers the
choices prompt-major: choice = prompt_index * n + sample index. Every prompt's stream runs in its own task
(the backend sees them as separate requests, at once); their chunks are merged in arrival order.

`open()` waits until every stream has produced its first chunk (or ended), so that an error any of them
raises before its first token (overload, input the engine rejects) becomes the answer's status code
rather than an event in a stream already begun; it then closes every stream and raises that error.
Closing (`aclose`, or leaving `async with`) cancels the streams still running, which aborts their requests.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from cluster.backend import Backend, GenerationChunk, GenerationRequest


@dataclass(frozen=True)
class ChoiceChunk:
    """One backend chunk of choice `choice` (prompt `prompt`)."""

    choice: int
    prompt: int
    chunk: GenerationChunk


class _Ended:
    pass


_ENDED = _Ended()


class ChoiceStreams:
    """Use as `async with ChoiceStreams(backend, requests, n) as streams: async for item in streams: ...`."""

    def __init__(self, backend: Backend, requests: Sequence[GenerationRequest], n: int) -> None:
        self._backend, self._requests, self._n = backend, list(requests), n
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._buffered: list[tuple[int, object]] = []
        self._open_streams = len(self._requests)

    async def __aenter__(self) -> "ChoiceStreams":
        await self.open()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Start every stream and wait for each one's first chunk or end; raises the first error any of them
        raised by then (every stream closed)."""
        self._tasks = [asyncio.ensure_future(self._pump(i, r)) for i, r in enumerate(self._requests)]
        waiting = set(range(len(self._requests)))
        try:
            while waiting:
                prompt, item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                waiting.discard(prompt)
                self._buffered.append((prompt, item))
        except BaseException:
            await self.aclose()
            raise

    def __aiter__(self) -> AsyncIterator[ChoiceChunk]:
        return self._merged()

    async def _merged(self) -> AsyncIterator[ChoiceChunk]:
        """Every chunk of every stream; raises a stream's error when it arrives."""
        while self._open_streams:
            prompt, item = self._buffered.pop(0) if self._buffered else await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is _ENDED:
                self._open_streams -= 1
                continue
            yield ChoiceChunk(prompt * self._n + item.index, prompt, item)

    async def aclose(self) -> None:
        """Cancel the streams still running (their requests are aborted) and wait for them to close."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _pump(self, prompt: int, request: GenerationRequest) -> None:
        try:
            async with aclosing(self._backend.generate(request)) as chunks:
                async for chunk in chunks:
                    self._queue.put_nowait((prompt, chunk))
            self._queue.put_nowait((prompt, _ENDED))
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self._queue.put_nowait((prompt, error))
