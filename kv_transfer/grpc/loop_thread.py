"""An asyncio event loop on its own daemon thread, for the gRPC transport's asyncio API."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


class EventLoopThread:
    """Runs one event loop forever on a dedicated thread until stop()."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> "Future[T]":
        """Schedules coro on the loop; the returned future completes with its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs coro on the loop and blocks the caller until it finishes."""
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        """Stops the loop and joins the thread; pending tasks are abandoned."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()
