"""Ray resources of a cluster: the placement group, the actors placed in it, and their release.

Runs in the process that starts the cluster (the serve process or a job's driver).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.workers.bounded import run_bounded
from cluster.workers.placement_check import PlacementInfeasible, check_placement
from cluster.workers.ray_host import RayHost

logger = logging.getLogger("tandem.cluster.placement")
RELEASE_TIMEOUT_S = 3.0  # per step of release_cluster that talks to Ray


@dataclass(frozen=True)
class ClusterResources:
    """What start_cluster set up and shutdown() releases: the placement group (None when every worker has one
    of its own: tensor-parallel workers, whose groups the coordinator's worker set holds), whether start_cluster called
    ray.init (then shutdown() calls ray.shutdown(), which
    disconnects this process), and the RayHost of the local Ray it started (None when it joined a
    cluster or used this process's Ray session; shutdown() stops it, which ends that Ray)."""

    placement_group: object
    owns_ray: bool
    ray_host: RayHost | None = None


def create_placement_group(num_workers: int, gpus: float, cpu_threads: int, strategy: str,
                           timeout_s: float) -> PlacementGroup:
    """One bundle per worker ({GPU: gpus, CPU: threads}, or {CPU: threads} when gpus is 0: a share below 1
    puts several workers on one GPU); see place_bundles."""
    bundle = {"CPU": cpu_threads, "GPU": gpus} if gpus else {"CPU": cpu_threads}
    return place_bundles([("worker", dict(bundle)) for _ in range(num_workers)], strategy, timeout_s)


def place_bundles(bundles: list[tuple[str, dict]], strategy: str, timeout_s: float,
                  label_selector: dict[str, str] | None = None, soft_target: str | None = None) -> PlacementGroup:
    """A placement group of `bundles` ((role, resources) per worker, in bundle order), placed. Fails fast
    with PlacementInfeasible (a ValueError naming what is missing) when the alive nodes can never hold
    them with `strategy`; otherwise waits at most timeout_s for Ray to place them, then removes the group
    and raises RuntimeError with what is free on each node. label_selector: the node labels every bundle
    needs; soft_target: the node id Ray tries first (STRICT_PACK only); both for workers added while
    serving (cluster/workers/added_placement.py)."""
    check_placement(bundles, strategy, alive_node_resources())
    selectors = [dict(label_selector) for _ in bundles] if label_selector else None
    group = placement_group([dict(bundle) for _, bundle in bundles], strategy=strategy,
                            bundle_label_selector=selectors, _soft_target_node_id=soft_target)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except Exception:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"Ray could not place {len(bundles)} workers ({strategy}) within {timeout_s:g}s: "
                           f"{_why_pending(bundles, strategy)}") from None
    return group


def alive_node_resources() -> dict[str, dict]:
    """The total resources of each alive node, by "node-id-prefix (node ip)"."""
    return {node_name(node["NodeID"], node["NodeManagerAddress"]): dict(node["Resources"])
            for node in ray.nodes() if node.get("Alive")}


def _why_pending(bundles: list[tuple[str, dict]], strategy: str) -> str:
    """What keeps the group from being placed with the resources free now (others hold the rest)."""
    try:
        free = ray._private.state.available_resources_per_node()
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")}
        free = {node_name(node_id, addresses.get(node_id, "?")): res for node_id, res in free.items()}
        check_placement(bundles, strategy, free)
    except PlacementInfeasible as error:
        return f"with the resources free now (the rest is held by others), {error}"
    except Exception as error:  # the private state API changed or Ray went away
        return f"free resources unknown ({error}); cluster resources: {ray.cluster_resources()}"
    keys = {key for _, bundle in bundles for key in bundle}
    return "free per node: " + ", ".join(f"{name} {({k: v for k, v in res.items() if k in keys})}"
                                         for name, res in free.items())


def node_name(node_id: str, address: str) -> str:
    """How errors name a node: its id's first 8 digits and its address."""
    return f"{node_id[:8]} ({address})"


def start_actor(actor_class, group: PlacementGroup, bundle_index: int, gpus: float, cpu_threads: int,
                *args):
    """Starts `actor_class(*args)` in bundle `bundle_index` of `group` (returns at once)."""
    strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle_index)
    return actor_class.options(num_cpus=cpu_threads, num_gpus=gpus,
                               scheduling_strategy=strategy).remote(*args)


async def stop_actors(actors: list, timeout_s: float) -> None:
    """Asks every actor to stop() (end its requests, wait for its transfers, stop its threads) and waits
    at most timeout_s; an actor already gone or still stopping then is left to release_cluster (killed)."""
    stops = [asyncio.ensure_future(actor.stop.remote()) for actor in actors]
    if not stops:
        return
    done, late = await asyncio.wait(stops, timeout=timeout_s)
    for stop in late:
        stop.cancel()
    for stop in done:
        if stop.exception() is not None:  # the actor is gone already: nothing to stop
            logger.info("worker stop: %s", stop.exception())
    if late:
        logger.warning("%d worker(s) did not stop within %.0fs; killing them", len(late), timeout_s)


def release_cluster(actors: list, resources: ClusterResources, timeout_s: float = RELEASE_TIMEOUT_S,
                    groups: tuple = ()) -> None:
    """Give back what start_cluster took, then release_ray. On a cluster this process joined (or its own
    Ray session) the actors are killed and the placement group (and `groups`: those of workers added while
    serving) removed, on a daemon thread given up on after timeout_s. A local Ray of our own is not asked:
    stopping its RayHost ends the actors and the placement groups with everything else of it, even when
    that Ray is already going away."""
    def kill_and_remove() -> None:
        from ray.util.placement_group import remove_placement_group
        for actor in actors:
            try:
                ray.kill(actor)
            except Exception:  # already gone
                pass
        for group in (resources.placement_group, *groups):
            if group is not None:  # None: the workers are tensor-parallel groups, each in a group of its own
                remove_placement_group(group)

    if resources.ray_host is None and not run_bounded(kill_and_remove, timeout_s):
        logger.warning("Ray did not release the workers within %.0fs; going on", timeout_s)
    release_ray(resources.owns_ray, resources.ray_host, timeout_s)


def release_ray(owns_ray: bool, host: RayHost | None, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
    """ray.shutdown() if this process ran ray.init (this process disconnects; given up on after
    timeout_s, or 1 s when the RayHost is gone already), then stop the RayHost, bounded by its own stop
    timeout: every process of a local Ray started here is gone when this returns."""
    if host is not None and not host.running:
        timeout_s = min(timeout_s, 1.0)  # no Ray left to say goodbye to
    if owns_ray and not run_bounded(ray.shutdown, timeout_s):
        logger.warning("ray.shutdown() did not return within %.0fs; going on", timeout_s)
    if host is not None:
        host.stop()
