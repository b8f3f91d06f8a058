"""One worker started (or released) while the cluster serves: its bundle, its actor, its engine loaded.

    started = start_added_worker(template, "decode", "decode-2", rank=5, peer_ranks=(0,), slot=None,
                                 timeout_s=300)
    ... started.info, started.actor ...
    release_added_worker(started.actor, started.slot)

A Ray placement group cannot grow or shrink, so an added worker gets a small group of its own (one bundle
of its role's shape; on a cluster with the Ray autoscaler a pending group is what asks for a new node),
or a bundle of the start group that a drained worker of the same role left free (`slot`). Releasing a
worker kills its actor and removes its own group; a bundle of the start group stays reserved for the next
worker of that role until the cluster shuts down. Blocking: the coordinator calls these through
asyncio.to_thread.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import ray

from cluster.workers.actors import WorkerInfo
from cluster.workers.bounded import run_bounded
from cluster.workers.placement import RELEASE_TIMEOUT_S, place_bundles, start_actor
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
                       slot: BundleSlot | None, timeout_s: float) -> StartedWorker:
    """Place (unless `slot` is given), start and load worker `name` of `role`; returns once its engine is
    loaded. On any failure what this call placed and started is released before the error propagates:
    PlacementInfeasible (a ValueError) when no alive node can ever hold its bundle, RuntimeError when Ray
    did not place it or the worker did not load within timeout_s."""
    if slot is None:
        group = place_bundles([(role, template.bundle(role))], "PACK", timeout_s)
        slot = BundleSlot(group, 0, owned=True)
    actor = None
    try:
        actor_class, args = template.actor_args(role, name, rank, peer_ranks)
        actor = start_actor(actor_class, slot.group, slot.index, template.gpus, template.cpu_threads,
                            template.spec, *args)
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
