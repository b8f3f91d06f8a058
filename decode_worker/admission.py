"""AdmissionControl: whether a decode worker takes one more request (backpressure, not failure).

A request is promised the blocks its prompt KV needs from expect() until that KV is admitted into the
engine (the engine's own accounting takes over then). A new request is refused while the pool's free
blocks minus the promised ones cannot hold its prompt plus some headroom, or while too many requests are
live. Thread-safe: expect() runs on the caller's thread, the rest on the step thread.
"""
from __future__ import annotations

import threading
from typing import Callable

from decode_worker.messages import Admission


class AdmissionControl:
    def __init__(self, block_size: int, free_blocks: Callable[[], int], max_live_requests: int,
                 headroom_blocks: int) -> None:
        self._block_size, self._free_blocks = block_size, free_blocks
        self._max_live, self._headroom = max_live_requests, headroom_blocks
        self._promised: dict[str, int] = {}   # live request id -> prompt blocks still promised
        self._closed = False
        self._lock = threading.Lock()

    def reserve(self, request_id: str, num_prompt_tokens: int) -> Admission:
        """Accept (the request is live and its prompt blocks promised) or refuse (nothing changes)."""
        blocks = -(-num_prompt_tokens // self._block_size)
        with self._lock:
            if self._closed:
                return Admission(False, "the decode worker is stopping")
            if request_id in self._promised:
                return Admission(False, f"request id {request_id!r} is already live here")
            if len(self._promised) >= self._max_live:
                return Admission(False, f"{len(self._promised)} requests live, the limit is {self._max_live}")
            room = self._free_blocks() - sum(self._promised.values())
            if room < blocks + self._headroom:
                return Admission(False, f"KV pool full: {room} blocks free, the prompt needs {blocks}")
            self._promised[request_id] = blocks
            return Admission(True)

    def kv_admitted(self, request_id: str) -> None:
        """The request's KV is in the engine now: its promise is kept, it stays live."""
        with self._lock:
            if request_id in self._promised:
                self._promised[request_id] = 0

    def release(self, request_id: str) -> None:
        """The request ended (any way): it is no longer live."""
        with self._lock:
            self._promised.pop(request_id, None)

    def close(self) -> None:
        """Refuse everything from now on."""
        with self._lock:
            self._closed = True

    @property
    def promised_blocks(self) -> int:
        with self._lock:
            return sum(self._promised.values())

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._promised)
