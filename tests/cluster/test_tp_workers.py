"""Workers that are tensor-parallel groups on a real local Ray (`tandem serve --replicas 2 --tp 2`): each replica is
rank 0's actor (the engine, what the coordinator sees) and a follower rank actor in a STRICT_PACK placement group
of its own, the ranks joined by gloo on 127.0.0.1 (CPU: the tiny Llama checkpoint, 4 query / 2 KV heads).

Greedy output equals transformers; a SIGKILLed follower rank takes its worker out (its requests migrate to the
other replica token for token, every rank of it ends); bad input (flags, a TP size that does not split the heads,
more ranks than a node holds) is a clear error at start with nothing left running. Every process the module's
local Ray started is gone at its end.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import time

import pytest
import ray

from cluster.coordinator.start import start_cluster
from cluster.serve import add_arguments
from cluster.serve import cluster_config as serve_cluster_config
from cluster.serve import config_from_args
from cluster.workers.cluster_config import ClusterConfig
from cluster.workers.placement_check import PlacementInfeasible, check_group_room
from engine import EngineConfig
from tests.support.cluster_rig import (POOL_BYTES, collect, greedy, kill_under_load, request, running_cluster,
                                      wait_until_idle)
from tests.support.engine_checks import random_prompts
from tests.support.fake_nodes import alive_actors
from tests.support.serve_process import descendants, live_processes

VOCAB = 300  # below the checkpoint's tokenizer vocabulary


def tp_config(path, tp: int = 2, replicas: int = 2, threads: int = 1) -> ClusterConfig:
    return ClusterConfig(model=str(path), dtype="float32", device="cpu", num_prefill_workers=0,
                         num_decode_workers=replicas, decode_tp=tp, engine=EngineConfig(kv_cache_memory=POOL_BYTES),
                         cpu_threads_per_worker=threads, worker_start_timeout_s=120.0)


def alive(pid: int) -> bool:
    return pid in live_processes()


def wait_gone(pids, timeout_s: float = 30.0) -> set[int]:
    """The pids still running after at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (left := {pid for pid in pids if alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def assert_actors(expected: list[str], timeout_s: float = 20.0) -> None:
    """The class names of the actors alive are `expected` (sorted) within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while sorted(alive_actors()) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sorted(alive_actors()) == expected


def live_groups() -> list:
    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def replicas(checkpoint):
    with running_cluster(tp_config(checkpoint)) as coordinator:  # it checks every process of it gone at the end
        yield coordinator


def test_tp_flags():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--replicas", "2", "--tp", "2", "--cpu-threads", "1"]))
    assert (config.replicas, config.decode_tp, config.prefill_tp) == (2, 2, 1)
    cluster = serve_cluster_config(config)
    assert (cluster.decode_tp, cluster.num_ranks, cluster.tensor_parallel) == (2, 4, True)
    assert config_from_args(parser.parse_args(["--tp", "2"])).decode_tp == 2   # the engine in this process
    disagg = serve_cluster_config(config_from_args(parser.parse_args(
        ["--prefill-workers", "1", "--decode-workers", "2", "--prefill-tp", "2", "--decode-tp", "1"])))
    assert (disagg.prefill_tp, disagg.decode_tp, disagg.num_ranks) == (2, 1, 4)
    for flags, match in ((["--replicas", "2", "--prefill-tp", "2"], "--prefill-tp sizes disaggregated workers"),
                         (["--replicas", "2", "--decode-tp", "2"], "colocated serving .* takes --tp N"),
                         (["--prefill-workers", "1", "--tp", "2"], "--tp N sizes colocated engines"),
                         (["--replicas", "2", "--tp", "0"], "--tp must be >= 1"),
                         (["--replicas", "2", "--tp", "2", "--gpus-per-worker", "0.5"], "one GPU per rank")):
        with pytest.raises(ValueError, match=match):
            config_from_args(parser.parse_args(flags))
    with pytest.raises(ValueError, match="colocated replicas have none: give each replica.s tensor-parallel size"):
        ClusterConfig(num_prefill_workers=0, prefill_tp=2)


def test_a_group_needs_its_ranks_on_one_node():
    """More ranks than a node has GPUs: the error names the size, the per-rank bundle and what is missing."""
    nodes = {"a1b2c3d4 (10.0.0.5)": {"CPU": 16, "GPU": 2}, "e5f6a7b8 (10.0.0.6)": {"CPU": 16, "GPU": 2}}
    check_group_room("decode", 2, {"CPU": 4, "GPU": 1}, nodes)
    with pytest.raises(PlacementInfeasible, match=r"decode worker of tensor-parallel size 4 runs its 4 ranks on one "
                                                  r"node .*more GPUs than any node has \(GPU: needs 4, the largest "
                                                  r"node has 2\)"):
        check_group_room("decode", 4, {"CPU": 4, "GPU": 1}, nodes)


def test_auto_device_refuses_too_few_gpus_for_the_ranks(monkeypatch):
    """A Ray cluster with one GPU and 2 replicas of 2 ranks: auto does not fall back to the CPU beside the GPU."""
    from cluster.workers import launch
    monkeypatch.setattr(launch.ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    config = ClusterConfig(num_prefill_workers=0, num_decode_workers=2, decode_tp=2)
    with pytest.raises(ValueError, match="4 tensor-parallel worker ranks need 4 GPUs .one per rank., the Ray "
                                         "cluster has 1"):
        launch.resolve_device(config)
    with pytest.raises(ValueError, match=r"device cuda needs 4 GPUs in the Ray cluster \(4 worker ranks x 1\)"):
        launch.resolve_device(dataclasses.replace(config, device="cuda"))
    assert launch.resolve_device(dataclasses.replace(config, decode_tp=1, num_decode_workers=1)) == "cuda"


def test_tp_replicas_greedy_equal_transformers(replicas, checkpoint, hf_greedy):
    """The coordinator sees 2 workers, each 2 ranks (2 processes) on one node; both serve; output = transformers."""
    workers = replicas.workers
    assert sorted(workers) == ["replica-0", "replica-1"]
    for info in workers.values():
        assert len(info.rank_pids) == 2 and info.rank_pids[0] == info.pid and all(map(alive, info.rank_pids))
    assert len({pid for info in workers.values() for pid in info.rank_pids}) == 4
    processes = live_processes()
    assert all(processes[info.rank_pids[1]].ppid != info.pid for info in workers.values())  # Ray's, not a child
    groups = live_groups()
    assert sorted((g["strategy"], len(g["bundles"])) for g in groups) == [("STRICT_PACK", 2)] * 2
    prompts = random_prompts([3, 17, 40, 9], VOCAB, seed=5)

    async def run_all():
        results = await asyncio.gather(*(collect(replicas, request(f"g{i}", p, greedy(6)))
                                         for i, p in enumerate(prompts)))
        await wait_until_idle(replicas)
        return results

    results = asyncio.run(run_all())
    assert [tokens for tokens, _ in results] == hf_greedy(checkpoint, prompts, 6)
    assert {last.timing.decode_worker for _, last in results} == {"replica-0", "replica-1"}


def test_bad_tp_sizes_fail_at_start_with_nothing_left(replicas, checkpoint):
    """On the module's Ray: a size that does not divide the 4 heads fails before anything starts; 4 ranks x 3
    CPUs fit no node of the 8-CPU Ray. No placement group, actor or process is left by either."""
    groups, processes = len(live_groups()), descendants(os.getpid())
    with pytest.raises(ValueError, match="replica workers: tensor_parallel_size 3 does not divide the model's 4 "
                                         "attention heads"):
        start_cluster(tp_config(checkpoint, tp=3, replicas=1))
    with pytest.raises(PlacementInfeasible, match="replica worker of tensor-parallel size 4 runs its 4 ranks on one "
                                                  "node .*CPU: needs 12, the largest node has 8"):
        start_cluster(tp_config(checkpoint, tp=4, replicas=1, threads=3))
    assert len(live_groups()) == groups and descendants(os.getpid()) <= processes


def test_a_tp_replica_added_and_drained_while_serving(replicas, checkpoint, hf_greedy):
    """Scale acts on the whole group: an added replica is 2 ranks in a STRICT_PACK group of its own and serves;
    drained, every rank of it ends and its group is removed."""
    prompts = random_prompts([5, 30, 12, 8, 50, 2], VOCAB, seed=7)

    async def run():
        added = (await replicas.scaling.scale("replica", 1))["started"]
        info = replicas.workers[added[0]]
        strategies = sorted((g["strategy"], len(g["bundles"])) for g in live_groups())
        results = await asyncio.gather(*(collect(replicas, request(f"s{i}", p, greedy(4)))
                                         for i, p in enumerate(prompts)))
        await wait_until_idle(replicas)
        drained = (await replicas.scaling.scale("replica", -1))["draining"]
        await replicas.scaling.settled()
        return info, strategies, results, drained

    info, strategies, results, drained = asyncio.run(run())
    assert info.name == "replica-2" and len(info.rank_pids) == 2 and strategies == [("STRICT_PACK", 2)] * 3
    assert [tokens for tokens, _ in results] == hf_greedy(checkpoint, prompts, 4)
    assert "replica-2" in {last.timing.decode_worker for _, last in results}
    assert drained == ["replica-2"] and not wait_gone(info.rank_pids)
    assert len(live_groups()) == 2 and sorted(replicas.workers) == ["replica-0", "replica-1"]


def test_a_killed_follower_rank_takes_its_worker_out_and_requests_migrate(replicas, checkpoint, hf_greedy):
    """Last: SIGKILL of replica-1's follower rank while four requests decode, two on each replica: replica-1 is
    lost (its rank 0 ends too), its two requests continue on replica-0, every client gets transformers' tokens,
    and replica-0 ends idle with its pool whole. Then replica-0's follower dies while it is idle: its rank 0
    ends at once too. Last, a replica added then has its rank 0 killed: its follower ends too."""
    prompts = random_prompts([20, 21, 22, 23], VOCAB, seed=10)
    expected = hf_greedy(checkpoint, prompts, 120)
    victim = replicas.workers["replica-1"]

    generations = [request(f"k{i}", p, greedy(120)) for i, p in enumerate(prompts)]
    results, health = asyncio.run(kill_under_load(replicas, generations,
                                                  lambda: os.kill(victim.rank_pids[1], signal.SIGKILL)))
    assert [tokens for tokens, _ in results] == expected
    assert [last.timing.decode_worker for _, last in results] == ["replica-0"] * 4
    assert sorted(last.timing.migrations for _, last in results) == [0, 0, 1, 1]
    assert health.serving and health.decode_workers == 1 and health.details["dead_workers"] == ["replica-1"]
    assert not wait_gone(victim.rank_pids), "a rank of the lost worker is still running"
    assert_actors(["DecodeActor", "TPRankActor"])   # replica-0's ranks, nothing of replica-1
    survivor = replicas.workers["replica-0"]
    assert all(map(alive, survivor.rank_pids))
    os.kill(survivor.rank_pids[1], signal.SIGKILL)  # idle: no step notices, rank 0 ends on the rank's death
    assert not wait_gone(survivor.rank_pids), "rank 0 of a worker whose follower died is still running"

    async def after():  # a stats round finds the dead actor; health() waits for a round only briefly, so poll
        deadline = time.monotonic() + 30
        while (health := await replicas.health()).serving and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return health

    health = asyncio.run(after())
    assert not health.serving and sorted(health.details["dead_workers"]) == ["replica-0", "replica-1"]

    async def add_one():
        return (await replicas.scaling.scale("replica", 1))["started"]

    (name,) = asyncio.run(add_one())
    added = replicas.workers[name]
    os.kill(added.pid, signal.SIGKILL)  # rank 0 dies: Ray ends the rank it owned
    assert not wait_gone(added.rank_pids), "a follower rank outlived its worker's rank 0"
    assert_actors([])
