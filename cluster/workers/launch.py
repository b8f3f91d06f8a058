"""launch_workers: Ray, a placement group, and the prefill and decode worker actors (or the colocated
replicas: decode worker actors without a KV receiver), loaded and ready.

    launched = launch_workers(ClusterConfig(num_prefill_workers=1, num_decode_workers=2))
    ... launched.workers: (WorkerInfo, actor handle) per worker, prefill workers first ...
    release_cluster([actor for _, actor in launched.workers], launched.resources,
                    groups=tuple(slot.group for slot in launched.slots if slot.owned))

With tensor-parallel workers (ClusterConfig.prefill_tp / decode_tp > 1) each worker has a STRICT_PACK placement
group of its own (launched.slots, owned; resources.placement_group is None) and starts its other ranks itself
(cluster/workers/tp_group.py). Blocking (it waits for every worker's engine to load).
cluster.coordinator.start_cluster calls it and puts a Coordinator over the workers.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from cluster.workers.actors import EngineSpec, WorkerInfo
from cluster.workers.added_placement import place_added_bundles
from cluster.workers.added_worker import BundleSlot
from cluster.workers.cluster_config import ClusterConfig
from cluster.workers.host_memory import cpu_kv_share
from cluster.workers.placement import (ClusterResources, alive_node_resources, place_bundles, release_cluster,
                                       release_ray, start_actor)
from cluster.workers.placement_check import check_group_room, check_placement
from cluster.workers.ray_host import RayHost, RayHostConfig, start_local_ray
from cluster.workers.worker_template import WorkerTemplate, worker_template
from decode_worker.no_receiver import NO_TRANSPORT
from engine.builder import resolve_model
from kv_transfer import resolve_transport

logger = logging.getLogger("tandem.cluster.start")


@dataclass(frozen=True)
class LaunchedWorkers:
    """The started workers (prefill first, then decode) and the Ray resources that hold them."""

    workers: tuple[tuple[WorkerInfo, object], ...]  # (what the worker reported, its actor handle)
    resources: ClusterResources
    model: str                                 # the model as the workers load it (resolve_model: a path or "tiny")
    template: WorkerTemplate                   # how to build more workers of this cluster while it serves
    slots: tuple[BundleSlot, ...] = ()         # where each worker sits (same order as workers)


def connect_ray(address: str | None, config: ClusterConfig,
                node_ip_address: str | None = None) -> tuple[bool, RayHost | None]:
    """Uses the session already initialized in this process, or joins `address` (as a driver on this
    machine's Ray node at `node_ip_address`, like `ray start --node-ip-address`: needed when the node's
    address is not the one Ray would pick, e.g. a cluster on 127.0.0.2), or starts a local Ray
    on 127.0.0.1 with enough logical CPUs for the workers' bundles, in a RayHost process of its own
    (cluster/workers/ray_host.py says why). Returns (whether this call ran ray.init, the RayHost if it
    started one)."""
    if ray.is_initialized():
        return False, None
    if address is not None:
        ray.init(address=address, include_dashboard=False, _node_ip_address=node_ip_address)
        return True, None
    num_cpus = max(os.cpu_count() or 1, config.most_ranks * config.cpu_threads_per_worker)
    host = start_local_ray(RayHostConfig(num_cpus=num_cpus, start_timeout_s=config.worker_start_timeout_s))
    return True, host


def resolve_device(config: ClusterConfig) -> str:
    """cpu or cuda for every worker: auto takes GPUs when the cluster has a share for every worker (every rank of
    a tensor-parallel worker: with some GPUs but too few for them, ValueError rather than the CPU)."""
    gpus = ray.cluster_resources().get("GPU", 0)
    needed = max(1, math.ceil(config.num_ranks * config.gpus_per_worker - 1e-9))
    if config.device == "cuda" and gpus < needed:
        workers = f"{config.num_ranks} worker ranks" if config.tensor_parallel else f"{config.num_workers} workers"
        raise ValueError(f"device cuda needs {needed} GPUs in the Ray cluster "
                         f"({workers} x {config.gpus_per_worker:g}), it has {gpus:g}")
    if config.device == "auto" and config.tensor_parallel and 0 < gpus < needed:
        raise ValueError(f"{config.num_ranks} tensor-parallel worker ranks need {needed} GPUs (one per rank), the Ray "
                         f"cluster has {gpus:g}: give a smaller tensor-parallel size, or --device cpu")
    if config.device == "auto":
        return "cuda" if gpus >= needed else "cpu"
    return config.device


def resolve_cluster_transport(config: ClusterConfig, device: str) -> str:
    """The concrete KV transport between any prefill and any decode worker: their pools are on one GPU when
    the workers share it, on two different GPUs otherwise, or on CPU."""
    same_host = len([n for n in ray.nodes() if n.get("Alive")]) <= 1
    return pair_transport(config, device, same_host)


def pair_transport(config: ClusterConfig, device: str, same_host: bool) -> str:
    if device != "cuda":
        if config.transport == "ipc":
            raise ValueError("transport 'ipc' needs the workers on a GPU; this cluster runs them on CPU")
        return resolve_transport(config.transport, "cpu", "cpu", same_host=same_host)
    receiver = torch.device("cuda", 0 if config.shares_gpu else 1)
    return resolve_transport(config.transport, torch.device("cuda", 0), receiver, same_host=same_host)


def engine_spec(config: ClusterConfig, model: str | None, device: str) -> EngineSpec:
    """What every worker builds: on a shared GPU, gpu_memory_utilization counts within the worker's share."""
    engine = config.engine
    if device == "cuda" and config.shares_gpu:
        engine = dataclasses.replace(engine, gpu_memory_utilization=engine.gpu_memory_utilization
                                     * config.gpus_per_worker)
    tokenizer = str(Path(config.tokenizer).resolve()) if config.tokenizer is not None else None
    return EngineSpec(model, config.dtype, device, engine, config.cpu_threads_per_worker, tokenizer)


def initial_workers(config: ClusterConfig) -> list[tuple[str, str, int, tuple[int, ...]]]:
    """(role, name, KV-plane rank, peer ranks) of each worker at start, prefill workers first: prefill
    workers 0..P-1 (senders), decode workers P..P+D-1 (receivers listening to every prefill rank); replicas
    replica-0..N-1 (no KV moves). Workers added later take the next ranks (cluster/coordinator/worker_set.py)."""
    num_prefill = config.num_prefill_workers
    prefill = [("prefill", f"prefill-{i}", i, ()) for i in range(num_prefill)]
    role = config.decode_role
    return prefill + [(role, f"{role}-{j}", num_prefill + j, tuple(range(num_prefill)))
                      for j in range(config.num_decode_workers)]


def with_cpu_kv_share(config: ClusterConfig) -> ClusterConfig:
    """config with every CPU worker's KV pool sized for this host (cluster/workers/host_memory.py), logged."""
    share = cpu_kv_share(config.engine.kv_cache_memory, config.most_ranks)  # each rank holds a pool
    logger.info("%s", share.describe())
    return dataclasses.replace(config, engine=dataclasses.replace(config.engine,
                                                                  kv_cache_memory=share.bytes_per_engine))


def launch_workers(config: ClusterConfig, address: str | None = None,
                   node_ip_address: str | None = None) -> LaunchedWorkers:
    """Start (or join) Ray, place the workers and wait until every engine is loaded. On any failure
    everything started here is released before the error propagates; a placement the cluster can never
    satisfy is a PlacementInfeasible (ValueError) before any worker starts."""
    host_cores = os.cpu_count() or 1
    workers_on_host = address is None and not ray.is_initialized()
    config = config.thread_share(host_cores, workers_on_host=workers_on_host)
    ranks = f" in {config.num_ranks} tensor-parallel ranks" if config.tensor_parallel else ""
    logger.info("workers: %d%s x %d CPU threads (this host: %d cores)", config.num_workers, ranks,
                config.cpu_threads_per_worker, host_cores)
    owns_ray, host = connect_ray(address, config, node_ip_address)
    group, slots = None, []
    actors: list = []
    try:
        device = resolve_device(config)
        transport = NO_TRANSPORT if config.replicas else resolve_cluster_transport(config, device)
        if device == "cpu" and workers_on_host and config.engine.num_kv_blocks is None:
            config = with_cpu_kv_share(config)
        model = resolve_model(config.model)
        template = worker_template(config, engine_spec(config, model, device), transport)
        workers = initial_workers(config)
        group, slots = place_workers(config, template, [role for role, *_ in workers])
        for slot, (role, name, rank, peers) in zip(slots, workers):
            actor_class, args = template.actor_args(role, name, rank, peers)
            actors.append(start_actor(actor_class, slot.group, slot.index, template.gpus, template.cpu_threads,
                                      template.spec_for(role), *args))
        infos: list[WorkerInfo] = ray.get([a.info.remote() for a in actors], timeout=config.worker_start_timeout_s)
    except BaseException:
        owned = tuple(slot.group for slot in slots if slot.owned)
        if group is not None or owned:
            release_cluster(actors, ClusterResources(group, owns_ray, host), groups=owned)
        else:
            release_ray(owns_ray, host)
        raise
    for info in infos:
        logger.info("%s: %s on node %s (%s; pid %d, GPUs %s, %d torch threads), %d KV blocks, transport %s",
                    info.name, info.device, info.node_id[:12], info.node_ip, info.pid,
                    ",".join(info.accelerator_ids) or "none", info.torch_threads, info.total_blocks, transport)
    return LaunchedWorkers(tuple(zip(infos, actors)), ClusterResources(group, owns_ray, host), model, template,
                           tuple(slots))


def place_workers(config: ClusterConfig, template: WorkerTemplate, roles: list[str]) -> tuple[object, list[BundleSlot]]:
    """(the start placement group or None, each worker's slot) for workers of `roles` (in start order). Without
    tensor parallelism: one group, a bundle per worker, by the cluster's strategy. With it: a STRICT_PACK group
    of its own per worker (a bundle per rank, rank 0's the slot), placed one after another by the strategy as
    added workers are (added_placement.py); PlacementInfeasible first when a worker's ranks fit no node or all
    of them do not fit the cluster."""
    if not config.tensor_parallel:
        bundles = [(role, template.bundle(role)) for role in roles]  # placement_check.worker_bundles' shapes
        group = place_bundles(bundles, config.placement_strategy, config.worker_start_timeout_s)
        return group, [BundleSlot(group, index, False) for index in range(len(roles))]
    nodes = alive_node_resources()
    for role in dict.fromkeys(roles):
        check_group_room(role, template.tp_size(role), template.bundle(role), nodes)
    check_placement([(role, template.group_bundle(role)) for role in roles], config.placement_strategy, nodes)
    slots: list[BundleSlot] = []
    try:
        for role in roles:
            slots += place_added_bundles(role, template.bundle(role), config.placement_strategy, slots, 1,
                                         config.worker_start_timeout_s, ranks=template.tp_size(role))
    except BaseException:
        for slot in slots:
            ray.util.remove_placement_group(slot.group)
        raise
    return None, slots
