"""A service a tensor-parallel group runs beside every follower rank's steps: what each rank needs of its own that the
engine does not know about (a KV transfer lane of its heads: kv_transfer/lanes/).

The engine stays independent of the service: rank 0's caller passes a picklable factory (`RankServiceFactory`, e.g.
a frozen dataclass with __call__) to build_engine(tp_rank_service=...); every follower calls it once, after its KV
pool exists and before it runs its first step, with that rank's RankContext, and closes what it returned when the
follower ends (STOP, an error, or rank 0 gone). The service runs on threads of its own; it may read and write the
follower's pool only in blocks rank 0 has handed to it (the steps never touch those blocks meanwhile).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class RankContext:
    """What a follower rank gives its service: who it is and its KV pool."""

    rank: int
    size: int
    kv: torch.Tensor           # [L, 2, num_blocks, block_size, kv_heads[1] - kv_heads[0], head_dim]: this rank's pool
    kv_heads: tuple[int, int]  # the model's KV heads [start, stop) the pool holds


class RankService(Protocol):
    def layer_done(self, step: int, layer: int) -> None:
        """On the follower's step thread, during the forward of step number `step` (the follower's count of rank 0's
        step messages, from 0) of a step whose message asks for it (StepInputs.lane_stream): layer `layer` has
        issued the work that writes its K/V (layers in order). Must not block."""

    def close(self) -> None:
        """Stops the service's threads and closes what it opened (called once, when the follower ends)."""


class RankServiceFactory(Protocol):
    def __call__(self, context: RankContext) -> RankService:
        """Starts the service of one follower rank (in the follower's process); raises if it cannot."""
