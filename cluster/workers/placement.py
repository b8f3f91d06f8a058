"""Ray resources of a cluster: the placement group, the actors placed in it, and their release.

Runs in the process that starts the cluster (the serve process or a job's driver).
"""
from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@dataclass(frozen=True)
class ClusterResources:
    """What start_cluster set up and shutdown() releases: the placement group, the gloo/nccl store
    (None for grpc) and whether start_cluster called ray.init (then shutdown() calls ray.shutdown(),
    which stops a local Ray it started, or disconnects from the cluster it joined)."""

    placement_group: object
    store: object | None
    owns_ray: bool


def create_placement_group(num_workers: int, use_gpu: bool, cpu_threads: int, strategy: str,
                           timeout_s: float) -> PlacementGroup:
    """One bundle per worker ({GPU: 1, CPU: threads} or {CPU: threads}); waits until it is placed."""
    bundle = {"CPU": cpu_threads, "GPU": 1} if use_gpu else {"CPU": cpu_threads}
    group = placement_group([dict(bundle) for _ in range(num_workers)], strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except Exception:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"Ray could not place {num_workers} workers of {bundle} ({strategy}) within "
                           f"{timeout_s}s; cluster resources: {ray.cluster_resources()}") from None
    return group


def start_actor(actor_class, group: PlacementGroup, bundle_index: int, use_gpu: bool, cpu_threads: int,
                *args):
    """Starts `actor_class(*args)` in bundle `bundle_index` of `group` (returns at once)."""
    strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle_index)
    return actor_class.options(num_cpus=cpu_threads, num_gpus=1 if use_gpu else 0,
                               scheduling_strategy=strategy).remote(*args)


def release_cluster(actors: list, resources: ClusterResources) -> None:
    """Kill the actors, remove the placement group, drop the store, stop Ray if this process owns it."""
    from ray.util.placement_group import remove_placement_group
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # already gone
            pass
    remove_placement_group(resources.placement_group)
    if resources.owns_ray:
        ray.shutdown()
