"""RoomQueue: the requests waiting for room on the decode workers, first come first served.

A request no decode worker (replica) took, some for lack of room, waits here, holding nothing, as it would in vLLM's
waiting queue. Only the request at the head asks the workers again: when a request ends anywhere (notify), and at
least every ROOM_RECHECK_S (a worker added, blocks a worker freed on its own). Once the head is admitted, or gives
up, the next one asks at once. A request that arrives while others wait joins behind them instead of asking first,
so a large prompt at the head is not passed for ever by small ones.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import AsyncIterator, Awaitable, Callable

ROOM_RECHECK_S = 0.1  # the head asks again at least this often

Turn = Callable[[float], Awaitable[bool]]


class RoomQueue:
    """Waiting requests in arrival order; one event loop's (not thread-safe)."""

    def __init__(self) -> None:
        self._waiting: collections.deque[list[asyncio.Future]] = collections.deque()  # a one-slot box each

    def __len__(self) -> int:
        return len(self._waiting)

    def notify(self) -> None:
        """Room may have come (a request ended): the head asks again."""
        if self._waiting:
            _wake(self._waiting[0])

    @contextlib.asynccontextmanager
    async def joined(self) -> AsyncIterator[Turn]:
        """Joins at the back; yields turn(deadline) -> bool. turn returns True once this request is at the head and
        room may have come (a notify, or ROOM_RECHECK_S at the head), False at `deadline` (time.monotonic()).
        Leaving (admitted, refused, or cancelled by the client) wakes the next request."""
        box = [asyncio.get_running_loop().create_future()]
        self._waiting.append(box)

        async def turn(deadline: float) -> bool:
            while (left := deadline - time.monotonic()) > 0:
                at_head = self._waiting[0] is box
                await asyncio.wait((box[0],), timeout=min(left, ROOM_RECHECK_S) if at_head else left)
                woken = box[0].done()
                if woken:
                    box[0] = asyncio.get_running_loop().create_future()
                if self._waiting[0] is box and (woken or at_head):
                    return True
            return False

        try:
            yield turn
        finally:
            self._waiting.remove(box)
            self.notify()


def _wake(box: list[asyncio.Future]) -> None:
    if not box[0].done():
        box[0].set_result(None)
