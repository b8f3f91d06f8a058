"""start_cluster: the worker actors on Ray (cluster.workers.launch) and a Coordinator over them.

    coordinator = start_cluster(ClusterConfig(num_prefill_workers=1, num_decode_workers=2))
    ... coordinator is a cluster.backend.Backend ...
    await coordinator.shutdown()            # workers, placement group, and Ray if started here

Blocking (it waits for every worker's engine to load); call it before the serving loop or through
asyncio.to_thread.
"""
from __future__ import annotations

from cluster.coordinator.coordinator import Coordinator
from cluster.coordinator.worker_set import Worker
from cluster.workers.cluster_config import ClusterConfig
from cluster.workers.launch import launch_workers
from cluster.workers.placement import release_cluster
from engine.builder import load_model_config, load_tokenizer
from engine.parallel.layout import check_tp_shapes


def start_cluster(config: ClusterConfig, address: str | None = None,
                  node_ip_address: str | None = None) -> Coordinator:
    """Start (or join) Ray, place the workers, wait until every engine is loaded, and return the
    Coordinator. The model and tokenizer are checked here first (ValueError naming the file and what is wrong,
    or the tensor-parallel size its shapes do not split by, before anything starts). On any failure everything
    started here is released before the error propagates."""
    model_config = load_model_config(config.model)
    for role in ("prefill", config.decode_role) if config.num_prefill_workers else (config.decode_role,):
        try:
            check_tp_shapes(model_config, config.tp_size(role))
        except ValueError as error:
            raise ValueError(f"{role} workers: {error}") from None
    tokenizer = load_tokenizer(config.model, config.tokenizer)  # the front ends encode prompts with it
    launched = launch_workers(config, address, node_ip_address)
    try:
        workers = [Worker(info, actor) for info, actor in launched.workers]
        return Coordinator(config, tokenizer, workers, launched.resources, launched.template, launched.slots)
    except BaseException:
        release_cluster([actor for _, actor in launched.workers], launched.resources,
                        groups=tuple(slot.group for slot in launched.slots if slot.owned))
        raise
