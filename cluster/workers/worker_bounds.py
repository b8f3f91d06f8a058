"""WorkerBounds: how many workers of each role a serving cluster may hold (frozen).

Workers are added and drained while serving (`POST /admin/workers`, `tandem scale`, the autoscaler:
cluster/coordinator/scaling.py); every change stays within these bounds. The decode bounds are the
replicas' in colocated replica mode (role "replica").
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerBounds:
    """min_*: the fewest workers of the role that may serve (at least 1: a drain below it is refused).
    max_*: the most (None: as many as the Ray cluster's alive nodes can hold; a number is trusted as it
    is, so that on a cluster with the Ray autoscaler an added worker's placement group can wait for a
    node the autoscaler adds)."""

    min_prefill: int = 1
    max_prefill: int | None = None
    min_decode: int = 1
    max_decode: int | None = None

    def __post_init__(self) -> None:
        for role, low, high in (("prefill", self.min_prefill, self.max_prefill),
                                ("decode", self.min_decode, self.max_decode)):
            if low < 1:
                raise ValueError(f"min_{role} must be >= 1 (a role with no worker serves nothing), got {low}")
            if high is not None and high < low:
                raise ValueError(f"max_{role} ({high}) must be >= min_{role} ({low})")

    def check_start(self, num_prefill: int, num_decode: int) -> None:
        """ValueError unless the starting worker counts are within the bounds (num_prefill 0: replicas,
        whose count is num_decode)."""
        roles = [("decode", num_decode, self.min_decode, self.max_decode)]
        if num_prefill:
            roles.insert(0, ("prefill", num_prefill, self.min_prefill, self.max_prefill))
        for role, count, low, high in roles:
            if count < low or (high is not None and count > high):
                raise ValueError(f"{count} {role} workers at start are outside the bounds [{low}, "
                                 f"{'no limit' if high is None else high}] (min_{role}, max_{role})")

    def of(self, role: str) -> tuple[int, int | None]:
        """(minimum, maximum) of a role: "prefill", or "decode" / "replica" (the decode side)."""
        return (self.min_prefill, self.max_prefill) if role == "prefill" else (self.min_decode, self.max_decode)
