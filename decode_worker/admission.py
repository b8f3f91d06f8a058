"""AdmissionControl: whether a decode worker takes one more request, and the blocks set aside for it.

Accepting a request reserves, from the engine's pool, the blocks its prompt KV will need: they are
taken out of the pool at once (growing decodes cannot eat them), handed to the KV receiver when that
request's transfer arrives (`take_reserved`, called with the manifest's request id), and given back to
the pool if the request ends before its KV came. A new request is refused (backpressure, not failure)
while too many are live, or while the pool cannot spare its prompt's blocks plus some headroom.
Thread-safe: expect() runs on the caller's thread, receivers on theirs, the rest on the step thread.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

from decode_worker.messages import Admission


class AdmissionControl:
    def __init__(self, block_size: int, free_count: Callable[[], int],
                 take_blocks: Callable[[int], list[int] | None], give_blocks: Callable[[Sequence[int]], None],
                 max_live_requests: int, headroom_blocks: int) -> None:
        self._block_size, self._free_count = block_size, free_count
        self._take_blocks, self._give_blocks = take_blocks, give_blocks
        self._max_live, self._headroom = max_live_requests, headroom_blocks
        self._reserved: dict[str, list[int]] = {}   # live request id -> blocks still set aside for its KV
        self._closed = False
        self._lock = threading.Lock()

    def reserve(self, request_id: str, num_prompt_tokens: int) -> Admission:
        """Accept (the request is live and its prompt's blocks are set aside) or refuse (nothing changes)."""
        needed = -(-num_prompt_tokens // self._block_size)
        with self._lock:
            if self._closed:
                return Admission(False, "the decode worker is stopping")
            if request_id in self._reserved:
                return Admission(False, f"request id {request_id!r} is already live here")
            if len(self._reserved) >= self._max_live:
                return Admission(False, f"{len(self._reserved)} requests live, the limit is {self._max_live}")
            free = self._free_count()
            blocks = self._take_blocks(needed) if free >= needed + self._headroom else None
            if blocks is None:
                return Admission(False, f"KV pool full: {free} blocks free, the prompt needs {needed} "
                                        f"(+{self._headroom} headroom)")
            self._reserved[request_id] = blocks
            return Admission(True)

    def take_reserved(self, request_id: str, num_blocks: int) -> list[int] | None:
        """The blocks set aside for `request_id`'s KV, handed to its transfer (now the transfer's to free).
        A transfer nobody reserved for, or of another size, gets fresh blocks from the pool (or None)."""
        with self._lock:
            blocks = self._reserved.get(request_id)
            if blocks and len(blocks) == num_blocks:
                self._reserved[request_id] = []
                return blocks
        return self._take_blocks(num_blocks)

    def unreserve(self, request_id: str) -> None:
        """The request no longer needs blocks set aside (it prefills here itself): they go back to the pool."""
        with self._lock:
            blocks = self._reserved.get(request_id)
            if blocks:
                self._reserved[request_id] = []
        if blocks:
            self._give_blocks(blocks)

    def release(self, request_id: str) -> None:
        """The request ended (any way): it is no longer live, and blocks still set aside go back."""
        with self._lock:
            blocks = self._reserved.pop(request_id, None)
        if blocks:
            self._give_blocks(blocks)

    def close(self) -> None:
        """Refuse everything from now on."""
        with self._lock:
            self._closed = True

    @property
    def promised_blocks(self) -> int:
        with self._lock:
            return sum(len(blocks) for blocks in self._reserved.values())

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._reserved)
