"""TransferSlots: at most N transfers in flight per decode worker; prefilled requests beyond that wait
(their KV stays in the engine's blocks) in arrival order. Step-thread only: no locks."""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Hashable


class TransferSlots:
    def __init__(self, limit: int | None) -> None:
        self._limit = limit
        self._in_flight: dict[Hashable, int] = defaultdict(int)
        self._waiting: dict[Hashable, deque[str]] = defaultdict(deque)

    def acquire(self, peer: Hashable, request_id: str) -> bool:
        """True: a slot to `peer` is taken for request_id (ship it now). False: it waits its turn."""
        if self._limit is None or self._in_flight[peer] < self._limit:
            self._in_flight[peer] += 1
            return True
        self._waiting[peer].append(request_id)
        return False

    def try_acquire(self, peer: Hashable) -> bool:
        """Takes a slot to `peer` if one is free now; queues nothing otherwise."""
        if self._limit is None or self._in_flight[peer] < self._limit:
            self._in_flight[peer] += 1
            return True
        return False

    def release_unused(self, peer: Hashable) -> None:
        """Gives back a slot from try_acquire that carried nothing (no one waits while a slot is free)."""
        self._in_flight[peer] -= 1

    def release(self, peer: Hashable) -> str | None:
        """A transfer to `peer` ended. Returns the next waiting request, which now holds the slot."""
        waiting = self._waiting.get(peer)
        if waiting:
            return waiting.popleft()
        self._in_flight[peer] -= 1
        return None

    def discard(self, peer: Hashable, request_id: str) -> bool:
        """Drops a waiting request (cancelled); True if it was waiting."""
        waiting = self._waiting.get(peer)
        if waiting and request_id in waiting:
            waiting.remove(request_id)
            return True
        return False

    @property
    def num_waiting(self) -> int:
        return sum(len(w) for w in self._waiting.values())
