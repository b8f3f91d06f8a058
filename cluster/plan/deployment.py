"""The ways to serve on W workers that the planner compares, named as `tandem bench compare` names them.

    colocated-W   W replicas, each an engine that prefills (chunked) and decodes (`tandem serve --replicas W`)
    disagg-PpDd   P prefill + D decode workers, P + D = W, the KV of each prompt moved between them
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Deployment:
    """One way to use the workers: `num_prefill` 0 means colocated replicas (`num_decode` of them)."""

    num_prefill: int
    num_decode: int

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(f"a deployment needs >= 1 decode worker (or replica), got {self}")

    @property
    def is_disaggregated(self) -> bool:
        return self.num_prefill > 0

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def name(self) -> str:
        if self.is_disaggregated:
            return f"disagg-{self.num_prefill}p{self.num_decode}d"
        return f"colocated-{self.num_decode}"


def deployments_for(workers: int) -> list[Deployment]:
    """colocated-W, then every split P:D of W workers (1p(W-1)d ... (W-1)p1d). ValueError when W < 1."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    return [Deployment(0, workers)] + [Deployment(p, workers - p) for p in range(1, workers)]
