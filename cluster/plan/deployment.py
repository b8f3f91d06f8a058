"""The ways to serve on a budget of G devices that the planner compares, named as `tandem bench compare` names them.

    colocated-R[-tpT]              R replicas, each an engine of T ranks that prefills (chunked) and decodes
                                   (`tandem serve --replicas R --tp T`): R x T devices
    disagg-PpDd[-ptpA][-dtpB]      P prefill workers of A ranks + D decode workers of B ranks, the KV of each prompt
                                   moved between them (`--prefill-tp A --decode-tp B`): P x A + D x B devices

A device is a GPU (one per rank), or on CPU a worker's share of --cpu-threads cores. A split is counted in
devices, not workers: with prefill TP=A and decode TP=B a split of G devices has P x A + D x B <= G. The
planner lists the splits that leave too few devices for one more worker of either role (with A = B = 1: every
P + D = G); a TP size (suffix) of 1 is left out of the name, so TP=1 names are the names of before. The names and
the split arithmetic are cluster/bench/compare_splits.py's, shared with `tandem bench compare`.
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.bench.compare_splits import check_tp_sizes, deployment_name, splits

__all__ = ["Deployment", "check_tp_sizes", "deployment_name", "deployments_for"]


@dataclass(frozen=True)
class Deployment:
    """One way to use the devices: `num_prefill` 0 means colocated replicas (`num_decode` of them, each of
    `decode_tp` ranks); `prefill_tp` / `decode_tp`: the ranks (devices) of each prefill / decode worker."""

    num_prefill: int
    num_decode: int
    prefill_tp: int = 1
    decode_tp: int = 1

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(f"a deployment needs >= 1 decode worker (or replica), got {self}")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError(f"a deployment's TP sizes must be >= 1, got {self}")
        if not self.num_prefill and self.prefill_tp != 1:
            raise ValueError(f"colocated replicas have no prefill workers to size: {self}")

    @property
    def is_disaggregated(self) -> bool:
        return self.num_prefill > 0

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def prefill_devices(self) -> int:
        return self.num_prefill * self.prefill_tp

    @property
    def decode_devices(self) -> int:
        """The decode workers' devices (the replicas' when colocated)."""
        return self.num_decode * self.decode_tp

    @property
    def num_devices(self) -> int:
        """GPUs (one per rank) or CPU worker shares the deployment takes: P x A + D x B."""
        return self.prefill_devices + self.decode_devices

    @property
    def name(self) -> str:
        return deployment_name(self.num_prefill, self.num_decode, self.prefill_tp, self.decode_tp)


def deployments_for(devices: int, prefill_tp: int = 1, decode_tp: int = 1, replica_tp: int = 1) -> list[Deployment]:
    """colocated-(G/T) replicas of `replica_tp` ranks, then every split P:D of G devices, P = 1, 2, ..., with
    P x prefill_tp + D x decode_tp <= G that leaves no room for one more worker of either role (cluster/bench/
    compare_splits.py). ValueError (check_tp_sizes: names the flag) on a bad budget or TP size."""
    check_tp_sizes(devices, prefill_tp, decode_tp, replica_tp)
    found = [Deployment(0, devices // replica_tp, 1, replica_tp)]
    return found + [Deployment(p, d, prefill_tp, decode_tp) for p, d in splits(devices, prefill_tp, decode_tp)]
