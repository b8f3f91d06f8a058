"""What the autoscaler sees of one role: its workers by state, its bounds, and the load the coordinator has
routed to its serving workers (RoleSnapshot, cluster/coordinator/autoscaler.py). Read-only."""
from __future__ import annotations

from collections.abc import Callable

from cluster.coordinator.autoscaler import RoleSnapshot
from cluster.coordinator.worker_set import WorkerSet, WorkerState
from cluster.workers.cluster_config import ClusterConfig


def role_snapshot(role: str, workers: WorkerSet, config: ClusterConfig, held: Callable[[str], tuple[int, int]],
                  stats: dict) -> RoleSnapshot:
    """`role`'s snapshot now. held(name): (requests, prompt tokens) routed to worker `name` and not ended;
    stats: the alive workers' DecodeStats / PrefillStats by name (free and total KV blocks of the decode
    side; a prefill worker's pool is not what limits it)."""
    serving = workers.names(role, WorkerState.SERVING)
    loads = [held(name) for name in serving]
    low, high = config.bounds.of(role)
    decode_side = role != "prefill"
    counted = [stats[name] for name in serving if name in stats and decode_side]
    return RoleSnapshot(role, len(serving), workers.count(role, WorkerState.STARTING, WorkerState.DRAINING), low, high,
                        queued_tokens=sum(tokens for _, tokens in loads),
                        running=sum(running for running, _ in loads) if decode_side else 0,
                        capacity=len(serving) * config.max_live_per_worker if decode_side else 0,
                        free_blocks=sum(s.free_blocks for s in counted),
                        total_blocks=sum(s.total_blocks for s in counted))
