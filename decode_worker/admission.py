"""AdmissionControl: whether a decode worker takes one more request, and the blocks set aside for it.

Accepting a request reserves, from the engine's pool, the blocks its prompt KV will need: they are
taken out of the pool at once (growing decodes cannot eat them), handed to the KV receiver when that
request's transfer arrives (`take_reserved`, called with the manifest's request id), and given back to
the pool if the request ends before its KV came. A new request is refused (backpressure, not failure)
while too many are live, or while the pool cannot spare its prompt's blocks plus some headroom.

With a `pin_prefix` callback (decoder-side prefix reuse), accepting a request first matches its prompt's
leading full blocks in the engine's prefix cache and pins them (a reference each, so they cannot be evicted
while the request waits); only the rest is reserved, and Admission.cached_blocks tells the coordinator how
many leading blocks the transfer may skip. The pins pass to the request's sequence at admission
(`take_pinned`) or are dropped when the request ends any other way (`release`), so none outlives it.
Thread-safe: expect() runs on the caller's thread, receivers on theirs, the rest on the step thread.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

from decode_worker.messages import Admission


class AdmissionControl:
    def __init__(self, block_size: int, free_count: Callable[[], int],
                 take_blocks: Callable[[int], list[int] | None], give_blocks: Callable[[Sequence[int]], None],
                 max_live_requests: int, headroom_blocks: int,
                 pin_prefix: Callable[[Sequence[int]], list[int]] | None = None) -> None:
        """pin_prefix(prompt) -> ids of the cached blocks holding the prompt's leading full blocks, a
        reference taken on each (engine.pin_cached_prefix); None: no decoder-side prefix reuse."""
        self._block_size, self._free_count = block_size, free_count
        self._take_blocks, self._give_blocks = take_blocks, give_blocks
        self._max_live, self._headroom = max_live_requests, headroom_blocks
        self._pin_prefix = pin_prefix
        self._reserved: dict[str, list[int]] = {}   # live request id -> blocks still set aside for its KV
        self._pinned: dict[str, list[int]] = {}     # live request id -> cached prompt blocks pinned for it
        self._closed = False
        self._lock = threading.Lock()

    def reserve(self, request_id: str, prompt_token_ids: Sequence[int]) -> Admission:
        """Accept (the request is live, its cached leading blocks pinned and the rest of its prompt's blocks
        set aside; Admission.cached_blocks says how many are cached) or refuse (nothing changes)."""
        needed = -(-len(prompt_token_ids) // self._block_size)
        with self._lock:
            refusal = self._refusal(request_id)
            if refusal is not None:
                return refusal
            pinned = self._pin_prefix(prompt_token_ids) if self._pin_prefix is not None else []
            rest = needed - len(pinned)
            free = self._free_count()
            blocks = self._take_blocks(rest) if free >= rest + self._headroom else None
            if blocks is None:
                if pinned:
                    self._give_blocks(pinned)
                return Admission(False, f"KV pool full: {free} blocks free, the prompt needs {rest} "
                                        f"(+{self._headroom} headroom)", for_room=True)
            self._reserved[request_id], self._pinned[request_id] = blocks, pinned
            return Admission(True, cached_blocks=len(pinned))

    def _refusal(self, request_id: str) -> Admission | None:
        if self._closed:
            return Admission(False, "the decode worker is stopping")
        if request_id in self._reserved:
            return Admission(False, f"request id {request_id!r} is already live here")
        if len(self._reserved) >= self._max_live:
            return Admission(False, f"{len(self._reserved)} requests live, the limit is {self._max_live}",
                             for_room=True)
        return None

    def take_pinned(self, request_id: str) -> list[int]:
        """The cached blocks pinned for `request_id` (its references now the caller's: they go to the
        request's sequence, or the caller frees them); empty when none are (left)."""
        with self._lock:
            pinned = self._pinned.get(request_id) or []
            if pinned:
                self._pinned[request_id] = []
            return pinned

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
        """The request ended (any way): it is no longer live; blocks still set aside go back, and pins not
        taken are dropped."""
        with self._lock:
            blocks = (self._reserved.pop(request_id, None) or []) + (self._pinned.pop(request_id, None) or [])
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
    def pinned_blocks(self) -> int:
        """Cached blocks pinned for live requests whose KV has not been admitted yet."""
        with self._lock:
            return sum(len(blocks) for blocks in self._pinned.values())

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._reserved)
