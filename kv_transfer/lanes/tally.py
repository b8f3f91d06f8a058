"""LaneTally: how far a request's lanes across a group have come (rank 0's bookkeeping, on both sides)."""
from __future__ import annotations

from kv_transfer.status import TransferStatus


class LaneTally:
    """Mixed into a request's record: `waiting` (the lanes not ended yet: receiving ranks, or the parts a sending
    group ships) and `failure` (the first failed lane's status and message, or None). Not thread-safe: its owner holds
    its lock."""

    waiting: set[int]
    failure: tuple[TransferStatus, str] | None

    def count_end(self, key: int, status: TransferStatus, message: str, label: str = "") -> bool | None:
        """Counts the end of lane `key` (described as label, default "rank {key}'s lane"): None when it was not
        waited for (counted before: nothing changes), else whether it is the first failure."""
        if key not in self.waiting:
            return None
        self.waiting.discard(key)
        first = status != TransferStatus.OK and self.failure is None
        if first:
            label = label or f"rank {key}'s lane"
            self.failure = (status, f"{label}: {message}")
        return first
