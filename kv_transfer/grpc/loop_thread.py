"""An asyncio event loop on its own daemon thread, for the gRPC transport's asyncio API; off_loop, a call that runs
beside it."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Callable, Coroutine, TypeVar

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


async def off_loop(call: Callable[[], T], undo: Callable[[T], object]) -> T:
    """call() on the default executor while the event loop serves other transfers. If the awaiting call is cancelled
    first (the client went away: its end is reported then), a success that comes later is undone: undo(result)."""
    future = asyncio.get_running_loop().run_in_executor(None, call)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(lambda done: None if done.cancelled() or done.exception() is not None
                                 else undo(done.result()))
        raise
