"""Workers sharing one GPU (`--gpus-per-worker` below 1): the configuration's rules, the transport and
engine share each worker gets, and Ray placing fractional-GPU bundles on one (logical) GPU."""
from __future__ import annotations

import argparse
import dataclasses

import pytest
import ray

from cluster.serve import add_arguments, config_from_args
from cluster.workers.cluster_config import ClusterConfig
from cluster.workers.launch import engine_spec, pair_transport
from cluster.workers.placement import create_placement_group, start_actor
from engine import EngineConfig
from tests.support.ray_start import start_ray


def test_a_share_below_one_puts_every_worker_on_one_gpu():
    assert ClusterConfig(gpus_per_worker=0.5).shares_gpu
    assert not ClusterConfig().shares_gpu
    ClusterConfig(num_prefill_workers=1, num_decode_workers=2, gpus_per_worker=1 / 3)
    with pytest.raises(ValueError, match="shares one GPU: 4 workers x 0.5"):
        ClusterConfig(num_prefill_workers=2, num_decode_workers=2, gpus_per_worker=0.5)
    for bad in (0.0, 1.5, -1.0):
        with pytest.raises(ValueError, match="gpus_per_worker must be in"):
            ClusterConfig(gpus_per_worker=bad)


def test_transport_follows_where_the_pools_are():
    shared, own = ClusterConfig(gpus_per_worker=0.5), ClusterConfig()
    assert pair_transport(shared, "cuda", same_host=True) == "ipc"
    assert pair_transport(own, "cuda", same_host=True) == "nccl"
    assert pair_transport(own, "cpu", same_host=True) == "gloo"
    assert pair_transport(dataclasses.replace(shared, transport="grpc"), "cuda", same_host=True) == "grpc"
    with pytest.raises(ValueError, match="ipc.*one GPU"):
        ClusterConfig(transport="ipc")
    with pytest.raises(ValueError, match="NCCL refuses two ranks"):
        ClusterConfig(transport="nccl", gpus_per_worker=0.5)
    with pytest.raises(ValueError, match="on CPU"):
        pair_transport(ClusterConfig(transport="ipc", gpus_per_worker=0.5), "cpu", same_host=True)


def test_memory_utilization_counts_within_the_share():
    config = ClusterConfig(gpus_per_worker=0.5, engine=EngineConfig(gpu_memory_utilization=0.8))
    assert engine_spec(config, None, "cuda").engine.gpu_memory_utilization == pytest.approx(0.4)
    assert engine_spec(config, None, "cpu").engine.gpu_memory_utilization == 0.8
    assert engine_spec(ClusterConfig(), None, "cuda").engine.gpu_memory_utilization == 0.85


def test_serve_flags():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--prefill-workers", "1", "--gpus-per-worker", "0.5"]))
    assert (config.mode, config.gpus_per_worker) == ("disaggregated", 0.5)
    with pytest.raises(ValueError, match="shares one GPU"):
        config_from_args(parser.parse_args(["--prefill-workers", "1", "--decode-workers", "2",
                                            "--gpus-per-worker", "0.5"]))
    with pytest.raises(ValueError, match="need --mode disaggregated"):
        config_from_args(parser.parse_args(["--gpus-per-worker", "0.5"]))
    with pytest.raises(ValueError, match="ipc"):
        config_from_args(parser.parse_args(["--prefill-workers", "1", "--transport", "ipc"]))


@ray.remote
class _GpuProbe:
    def gpu_ids(self) -> list:
        return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def test_ray_places_fractional_bundles_on_one_gpu():
    """A node with one logical GPU takes two workers of half a GPU each, and both get that GPU's id."""
    ray.shutdown()  # a Ray of earlier tests, if one runs (none in a full run: __init__.py): this one has a GPU
    start_ray(lambda: ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2,
                               num_gpus=1, log_to_driver=False))
    try:
        group = create_placement_group(2, 0.5, 1, "PACK", timeout_s=60)
        probes = [start_actor(_GpuProbe, group, index, 0.5, 1) for index in range(2)]
        assert ray.get([p.gpu_ids.remote() for p in probes], timeout=60) == [["0"], ["0"]]
        ray.util.remove_placement_group(group)
    finally:
        ray.shutdown()


def test_the_cpu_threads_of_each_worker_come_from_the_hosts_cores():
    two = ClusterConfig(num_prefill_workers=1, num_decode_workers=1)
    assert two.thread_share(8, workers_on_host=True).cpu_threads_per_worker == 4
    assert two.thread_share(2, workers_on_host=True).cpu_threads_per_worker == 1
    assert ClusterConfig(num_prefill_workers=2, num_decode_workers=2).thread_share(
        3, workers_on_host=True).cpu_threads_per_worker == 1          # at least one each
    lone = ClusterConfig(num_prefill_workers=0, num_decode_workers=1)  # one replica: every core
    assert lone.thread_share(8, workers_on_host=True).cpu_threads_per_worker == 8
    asked = ClusterConfig(num_prefill_workers=1, num_decode_workers=1, cpu_threads_per_worker=3)
    assert asked.thread_share(8, workers_on_host=True).cpu_threads_per_worker == 3
    with pytest.raises(ValueError, match="2 workers x 3 CPU threads is more than this host's 4 cores"):
        asked.thread_share(4, workers_on_host=True)
    assert asked.thread_share(4, workers_on_host=False).cpu_threads_per_worker == 3  # other nodes: not checked here
