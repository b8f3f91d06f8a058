"""Tensor-parallel workers across Ray nodes (ray.cluster_utils.Cluster on 127.0.0.2: the package's cluster,
conftest.py, whose nodes of 1 CPU hold no rank group, and two nodes of 2 CPUs each added for this module): with
--placement-strategy STRICT_SPREAD each replica's 2 ranks are STRICT_PACKed on one node and the two replicas on
different nodes, and they serve transformers' greedy tokens; a third replica fits no node beside them; a prefill
group and a decode group of 2 ranks, each on a node of its own, move the KV by lanes between the nodes; at the end
nothing of the cluster is left.
"""
from __future__ import annotations

import asyncio

import pytest
import ray

from cluster.backend import ScaleRefused
from cluster.coordinator.start import start_cluster
from cluster.workers.cluster_config import ClusterConfig
from engine import EngineConfig
from tests.support.cluster_rig import POOL_BYTES, collect, greedy, request, wait_until_idle
from tests.support.engine_checks import random_prompts
from tests.support.fake_nodes import NODE_IP, assert_released


@pytest.fixture(scope="module")
def two_cpu_nodes(fake) -> list[str]:
    """Two nodes of 2 CPUs (no GPU, no pool) added to the package's cluster; removed at the end of the module."""
    nodes = [fake.cluster.add_node(num_cpus=2, node_ip_address=NODE_IP) for _ in range(2)]
    fake.cluster.wait_for_nodes()
    yield [node.node_id for node in nodes]
    for node in nodes:
        fake.cluster.remove_node(node)


def test_spread_groups_each_packed_on_a_node(two_cpu_nodes, tiny_checkpoint, hf_greedy):
    path = tiny_checkpoint("llama")
    config = ClusterConfig(model=str(path), dtype="float32", device="cpu", num_prefill_workers=0,
                           num_decode_workers=2, decode_tp=2, placement_strategy="STRICT_SPREAD",
                           engine=EngineConfig(kv_cache_memory=POOL_BYTES), cpu_threads_per_worker=1,
                           worker_start_timeout_s=120.0)
    coordinator = start_cluster(config)
    pids = {pid for info in coordinator.workers.values() for pid in info.rank_pids}
    try:
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        nodes = [set(g["bundles_to_node_id"].values()) for g in groups]
        assert [(g["strategy"], len(g["bundles"])) for g in groups] == [("STRICT_PACK", 2)] * 2
        assert all(len(n) == 1 for n in nodes) and nodes[0] != nodes[1]   # a node per group, all its ranks there
        assert nodes[0] | nodes[1] == set(two_cpu_nodes)                   # the only nodes that hold 2 ranks
        assert {info.node_id for info in coordinator.workers.values()} == nodes[0] | nodes[1]
        assert all(len(info.rank_pids) == 2 for info in coordinator.workers.values())
        prompts = random_prompts([4, 19, 33, 7], 300, seed=3)

        async def run():
            results = await asyncio.gather(*(collect(coordinator, request(f"n{i}", p, greedy(5)))
                                             for i, p in enumerate(prompts)))
            await wait_until_idle(coordinator)
            with pytest.raises(ScaleRefused, match="more than the Ray cluster can hold"):
                await coordinator.scaling.scale("replica", 1)
            return results

        results = asyncio.run(run())
        assert [tokens for tokens, _ in results] == hf_greedy(path, prompts, 5)
        assert {last.timing.decode_worker for _, last in results} == {"replica-0", "replica-1"}
    finally:
        asyncio.run(coordinator.shutdown())
    assert_released(pids)


def test_kv_lanes_between_groups_on_two_nodes(two_cpu_nodes, tiny_checkpoint, hf_greedy):
    """A prefill group of 2 ranks on one node and a decode group of 2 on the other: each prefill rank's heads go to
    its decode rank over gRPC between the nodes (KV lanes, kv_transfer/lanes/), and the tokens are transformers'."""
    path = tiny_checkpoint("llama")
    config = ClusterConfig(model=str(path), dtype="float32", device="cpu", num_prefill_workers=1,
                           num_decode_workers=1, prefill_tp=2, decode_tp=2, transport="grpc",
                           placement_strategy="STRICT_SPREAD", engine=EngineConfig(kv_cache_memory=POOL_BYTES),
                           cpu_threads_per_worker=1, worker_start_timeout_s=120.0)
    coordinator = start_cluster(config)
    pids = {pid for info in coordinator.workers.values() for pid in info.rank_pids}
    try:
        assert {info.node_id for info in coordinator.workers.values()} == set(two_cpu_nodes)
        assert len(coordinator.workers["decode-0"].kv_address.lanes) == 2
        prompts = random_prompts([6, 21, 35], 300, seed=4)

        async def run():
            results = await asyncio.gather(*(collect(coordinator, request(f"l{i}", p, greedy(5)))
                                             for i, p in enumerate(prompts)))
            return results, await wait_until_idle(coordinator)

        results, stats = asyncio.run(run())
        assert [tokens for tokens, _ in results] == hf_greedy(path, prompts, 5)
        assert stats["prefill-0"].lane_transfers == len(prompts)
    finally:
        asyncio.run(coordinator.shutdown())
    assert_released(pids)
