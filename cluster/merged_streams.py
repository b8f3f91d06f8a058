"""MergedStreams: several async iterators run at once, each in a task of its own, their items merged in
arrival order as (stream number, item).

`open()` waits until every stream has produced its first item or ended, so that an error a stream raises
before its first item (a backend refusing the request, say) surfaces there, before the caller has sent
anything, rather than in the middle of the merged stream; it then closes every stream and raises that
error. Iterating raises a stream's error when it arrives. Closing (`aclose`) cancels the streams still
running and waits for them: each task closes its iterator (`aclose`), which is how a backend stream aborts
its request. Used by the OpenAI front end (the prompts of a batch) and the coordinator (the n samples of a
request).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing


class _Ended:
    pass


_ENDED = _Ended()


class MergedStreams:
    """Use from one asyncio loop: `await open()`, `async for number, item in merged`, `await aclose()`."""

    def __init__(self, streams: Sequence[AsyncIterator]) -> None:
        """streams: async generators (or anything with aclose) that nobody has started iterating."""
        self._streams = list(streams)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._buffered: list[tuple[int, object]] = []
        self._running = len(self._streams)

    async def open(self) -> None:
        """Start every stream and wait for each one's first item or end; raises the first error any of them
        raised by then (every stream closed)."""
        self._tasks = [asyncio.ensure_future(self._pump(n, stream)) for n, stream in enumerate(self._streams)]
        waiting = set(range(len(self._streams)))
        try:
            while waiting:
                number, item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                waiting.discard(number)
                self._buffered.append((number, item))
        except BaseException:
            await self.aclose()
            raise

    def __aiter__(self) -> AsyncIterator[tuple[int, object]]:
        return self._merged()

    async def _merged(self) -> AsyncIterator[tuple[int, object]]:
        while self._running:
            number, item = self._buffered.pop(0) if self._buffered else await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is _ENDED:
                self._running -= 1
                continue
            yield number, item

    async def aclose(self) -> None:
        """Cancel the streams still running (each closes its iterator) and wait for them to end."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self._streams[len(self._tasks):]:  # never started: closing one that never ran
            await stream.aclose()

    async def _pump(self, number: int, stream: AsyncIterator) -> None:
        try:
            async with aclosing(stream) as items:
                async for item in items:
                    self._queue.put_nowait((number, item))
            self._queue.put_nowait((number, _ENDED))
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self._queue.put_nowait((number, error))
