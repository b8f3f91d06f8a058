"""A deadline on the running task without a task of its own (asyncio.wait_for wraps each call in a new task:
a task and a loop iteration more per transfer, on a path that costs a few hundred microseconds in all)."""
from __future__ import annotations

import asyncio


class Deadline:
    """`with Deadline(seconds):` cancels the running task once `seconds` have passed, and turns that
    cancellation (only that one) into asyncio.TimeoutError when it leaves the block. Any other
    cancellation passes through unchanged. Loop thread only."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.expired = False
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None

    def __enter__(self) -> "Deadline":
        self._task = asyncio.current_task()
        self._timer = asyncio.get_running_loop().call_later(self.seconds, self._expire)
        return self

    def _expire(self) -> None:
        self.expired = True
        self._task.cancel()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._timer.cancel()
        if self.expired and exc_type is asyncio.CancelledError:
            uncancel = getattr(self._task, "uncancel", None)  # Python 3.11+: the cancel is consumed here
            if uncancel is not None:
                uncancel()
            raise asyncio.TimeoutError(f"deadline of {self.seconds}s passed") from None
        return False
