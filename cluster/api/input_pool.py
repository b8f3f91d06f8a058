"""The bounded pool of threads that prepares large requests (parses, renders, tokenizes) off the event loop.

A request whose input (an HTTP body, a gRPC prompt) is larger than InputLimits.off_loop_bytes is prepared on
one of `workers` threads of the pool, never on the event loop that answers everyone else: the probes, small
requests, the streams in flight. Smaller inputs are prepared on the loop, where a thread hop would cost more
than they do. At most `max_waiting` large inputs wait for a thread; one more is refused at once with
BackendOverloaded (429 / RESOURCE_EXHAUSTED), so however many arrive, the work queued before admission is
bounded. A waiting input whose client leaves is dropped unprepared; one being prepared finishes on its thread
(Python cannot interrupt it) and keeps that thread until then, so the bound on threads holds whatever clients do.

Threads share the GIL: the long part of what runs here must release it (the tokenizers library's batch calls
do, prompt_encoder.py uses them) or the loop waits for it anyway. What holds it, json.loads of a body for one,
holds it for one call bounded by the body limit (7 ms for a 3.9 MB prompt, ~100 ms for 4 MiB of token ids).
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from cluster.api.request_validation import OFF_LOOP_INPUT_CHARS
from cluster.backend import BackendOverloaded

T = TypeVar("T")


def default_workers() -> int:
    """A quarter of the CPUs this process may use, at least one: on 2 cores one thread prepares large inputs and
    the other core stays with the loop and the engine."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, usable // 4)


@dataclass(frozen=True)
class InputLimits:
    """Inputs over off_loop_bytes (bytes of an HTTP body, characters of a gRPC prompt) are prepared on one of
    `workers` threads; at most max_waiting more wait for one, past that they are refused (429 /
    RESOURCE_EXHAUSTED)."""

    off_loop_bytes: int = OFF_LOOP_INPUT_CHARS
    workers: int = field(default_factory=default_workers)
    max_waiting: int = 64

    def __post_init__(self) -> None:
        for name, least in (("off_loop_bytes", 0), ("workers", 1), ("max_waiting", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


class InputPool:
    """Runs the preparation of large inputs on its threads (see the module docstring). Use from one asyncio loop;
    close() when the front ends that share it stop."""

    def __init__(self, limits: InputLimits = InputLimits()) -> None:
        self.limits = limits
        self._executor = ThreadPoolExecutor(limits.workers, thread_name_prefix="tandem-input")
        self._pending = 0  # submitted and neither finished nor dropped; changed on the loop only

    @property
    def pending(self) -> int:
        """Large inputs being prepared or waiting for a thread."""
        return self._pending

    async def prepare(self, size: int, work: Callable[[], T]) -> T:
        """work()'s result or exception: run here when `size` is at most limits.off_loop_bytes, else on a thread
        of the pool. BackendOverloaded, with `work` not run, when workers + max_waiting inputs are pending.
        Cancelling the caller drops a `work` still waiting; a running one finishes, its result discarded."""
        if size <= self.limits.off_loop_bytes:
            return work()
        if self._pending >= self.limits.workers + self.limits.max_waiting:
            raise BackendOverloaded(f"{self._pending} large requests are being prepared or waiting, the limit is "
                                    f"{self.limits.workers + self.limits.max_waiting}; retry later")
        loop = asyncio.get_running_loop()
        future = self._executor.submit(work)
        self._pending += 1
        future.add_done_callback(lambda _: _call_soon(loop, self._finished))
        return await asyncio.wrap_future(future, loop=loop)

    def close(self) -> None:
        """Drops the inputs still waiting and lets the threads end once their work is done; prepare() then
        raises RuntimeError for a large input."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _finished(self) -> None:
        self._pending -= 1


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """callback on `loop`, from any thread; nothing once the loop is closed (the count dies with it)."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        pass

