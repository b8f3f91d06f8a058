"""LaneTally: how far a request's lanes across a group have come (rank 0's bookkeeping, on both sides)."""
from __future__ import annotations

from kv_transfer.status import TransferStatus


class LaneTally:
    """Mixed into a request's record: `waiting` (the ranks whose lane has not ended) and `failure` (the first failed
    lane's status and message, or None). Not thread-safe: its owner holds its lock."""

    waiting: set[int]
    failure: tuple[TransferStatus, str] | None

    def count_end(self, rank: int, status: TransferStatus, message: str) -> bool | None:
        """Counts the end of rank's lane: None when it was not waited for (counted before: nothing changes), else
        whether it is the first failure."""
        if rank not in self.waiting:
            return None
        self.waiting.discard(rank)
        first = status != TransferStatus.OK and self.failure is None
        if first:
            self.failure = (status, f"rank {rank}'s lane: {message}")
        return first
