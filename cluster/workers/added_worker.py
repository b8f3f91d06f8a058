"""One worker started (or released) while the cluster serves: its actor in its bundle, its engine loaded.

    started = start_added_worker(template, "decode", "decode-2", rank=5, peer_ranks=(0,), slot=slot,
                                 timeout_s=300)
    ... started.info, started.actor ...
    release_added_worker(started.actor, started.slot)

A Ray placement group cannot grow or shrink, so an added worker sits in a small group of its own (one bundle
of its role's shape, placed by the cluster's placement strategy: cluster/workers/added_placement.py; on a
cluster with the Ray autoscaler a pending group is what asks for a new node), or in a bundle of the start
group that a drained worker of the same role left free. Releasing a worker kills its actor and removes its
own group; a bundle of the start group stays reserved for the next worker of that role until the cluster
shuts down. Blocking: the coordinator calls these through asyncio.to_thread.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import ray

from cluster.workers.actors import WorkerInfo
from cluster.workers.bounded import run_bounded
from cluster.workers.placement import RELEASE_TIMEOUT_S, start_actor
from cluster.workers.worker_template import WorkerTemplate

logger = logging.getLogger("tandem.cluster.added_worker")


@dataclass(frozen=True)
class BundleSlot:
    """Where a worker sits: bundle `index` of placement group `group`; `owned`: the group is the worker's own
    (removed with it), else a bundle of the start group (kept for the next worker of its role)."""

    group: object
    index: int
    owned: bool


@dataclass(frozen=True)
class StartedWorker:
    info: WorkerInfo
    actor: object
    slot: BundleSlot


def start_added_worker(template: WorkerTemplate, role: str, name: str, rank: int, peer_ranks: tuple[int, ...],
                       slot: BundleSlot, timeout_s: float) -> StartedWorker:
    """Start worker `name` of `role` in its placed bundle `slot` and load it; returns once its engine is
    loaded. On any failure the actor and the slot (if owned) are released before the error propagates
    (RuntimeError / GetTimeoutError when the worker did not load within timeout_s)."""
    actor = None
    try:
        actor_class, args = template.actor_args(role, name, rank, peer_ranks)
        actor = start_actor(actor_class, slot.group, slot.index, template.gpus, template.cpu_threads,
                            template.spec_for(role), *args)
        info: WorkerInfo = ray.get(actor.info.remote(), timeout=timeout_s)
    except BaseException:
        release_added_worker(actor, slot)
        raise
    logger.info("%s: %s on node %s (%s; pid %d), %d KV blocks, added while serving", info.name, info.device,
                info.node_id[:12], info.node_ip, info.pid, info.total_blocks)
    return StartedWorker(info, actor, slot)


def release_added_worker(actor, slot: BundleSlot, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
    """Kill the actor (if any) and remove the slot's group if it is the worker's own; bounded by timeout_s
    (a Ray that is going away cannot hold it up)."""
    def kill_and_remove() -> None:
        if actor is not None:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if slot.owned:
            ray.util.remove_placement_group(slot.group)

    if not run_bounded(kill_and_remove, timeout_s):
        logger.warning("Ray did not release a worker within %.0fs; going on", timeout_s)
