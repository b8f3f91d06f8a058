"""Admission of gRPC transfers on the receiver: a concurrency limit with a bounded FIFO queue behind it."""
from __future__ import annotations

import asyncio
from collections import deque

from kv_transfer.status import KVTransferError, TransferStatus


class AdmissionQueue:
    """At most `limit` transfers are admitted at once; up to `max_queued` more wait in arrival order.

    Used only from the receiver's event-loop thread (no locks). A waiter holds nothing but its call: the
    receiver reads a transfer's manifest, waits here, and allocates blocks only once admitted."""

    def __init__(self, limit: int, max_queued: int):
        if limit < 1 or max_queued < 0:
            raise ValueError("limit must be >= 1 and max_queued >= 0")
        self.limit, self.max_queued = limit, max_queued
        self.active = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        """Transfers waiting for a slot right now."""
        return len(self._waiters)

    async def enter(self, timeout_s: float, request_id: str = "") -> None:
        """Takes a slot, waiting in FIFO order for at most timeout_s. On return the caller holds one slot
        and must call leave() exactly once. Raises KVTransferError REJECTED_BUSY (queue full) or TIMEOUT
        (no slot in time) without holding a slot; a cancelled waiter leaves the queue holding nothing."""
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise KVTransferError(TransferStatus.REJECTED_BUSY, f"{self.active} transfers active and "
                                  f"{len(self._waiters)} queued (the most this receiver queues)", request_id)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except asyncio.TimeoutError:
            self._give_up(waiter)
            raise KVTransferError(TransferStatus.TIMEOUT, f"waited {timeout_s}s in the receiver's queue",
                                  request_id) from None
        except BaseException:  # the call went away while it waited
            self._give_up(waiter)
            raise

    def _give_up(self, waiter: asyncio.Future) -> None:
        if waiter.done():  # leave() handed this waiter the slot just as it gave up: pass the slot on
            self.leave()
        else:
            waiter.cancel()
            self._waiters.remove(waiter)

    def leave(self) -> None:
        """Gives a slot back: the oldest waiter gets it directly (so a newcomer cannot overtake the queue)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1
