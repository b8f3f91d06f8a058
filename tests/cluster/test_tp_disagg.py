"""Disaggregated serving with tensor-parallel workers on a real local Ray: a prefill group of 2 ranks hands its KV to a
single-rank decode worker over gRPC, and a single-rank prefill worker to decode groups of 2 ranks over gloo with layer
streaming. The KV moves by KV lanes (kv_transfer/lanes/), rank to rank: each rank's heads
from the prefill rank that holds them straight to the decode rank that holds them, merged into the single rank or
split over the group's ranks (kv_transfer/lanes/parts.py). Greedy output equals transformers, a second wave sharing
prefixes reuses the decode side's cached blocks, every worker ends idle with its pool whole; a SIGKILLed decode rank
under load takes its worker out and its requests migrate to the other decode group, token for token, no rank of it
left running. (CPU: the tiny Llama checkpoint, 4 query / 2 KV heads, one KV head per rank.)"""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from cluster.workers.cluster_config import ClusterConfig
from engine import EngineConfig
from tests.cluster.test_tp_workers import assert_actors, wait_gone
from tests.support.cluster_rig import (POOL_BYTES, collect, greedy, kill_under_load, request, running_cluster,
                                      wait_until_idle)
from tests.support.engine_checks import random_prompts

VOCAB = 300
KILLED_TOKENS = 40  # the rank dies once every request has its first token: they are all mid-way then


def disagg_config(path, prefill_tp: int, decode_tp: int, decode_workers: int, transport: str) -> ClusterConfig:
    return ClusterConfig(model=str(path), dtype="float32", device="cpu", num_prefill_workers=1,
                         num_decode_workers=decode_workers, prefill_tp=prefill_tp, decode_tp=decode_tp,
                         transport=transport, engine=EngineConfig(kv_cache_memory=POOL_BYTES, block_size=8),
                         cpu_threads_per_worker=1, worker_start_timeout_s=120.0)


def two_waves(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Wave 2's first prompts start with wave 1's first 32 tokens (4 blocks the decode side then holds)."""
    wave1 = random_prompts([3, 40, 17, 60], VOCAB, seed=seed)
    tails = random_prompts([5, 9], VOCAB, seed=seed + 1)
    return wave1, [wave1[1][:32] + tails[0], wave1[3][:32] + tails[1]]


def serve_waves(coordinator, waves: list[list[list[int]]], max_tokens: int, groups: list[str]) -> list[list]:
    """Each wave's results; then every worker idle with its pool whole, and `groups` (the TP workers) with their
    staging pools whole too."""
    async def run():
        results = []
        for number, prompts in enumerate(waves):
            results.append(await asyncio.gather(*(collect(coordinator, request(f"w{number}-{i}", p, greedy(max_tokens)))
                                                  for i, p in enumerate(prompts))))
        stats = await wait_until_idle(coordinator)  # every worker: no request, every block free (staging too)
        assert all(stats[name].staging_total > 0 for name in groups)
        return results

    return asyncio.run(run())


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


def test_a_prefill_group_of_2_ranks_hands_kv_to_a_single_rank_decode_worker(checkpoint, hf_greedy):
    wave1, wave2 = two_waves(seed=31)
    with running_cluster(disagg_config(checkpoint, prefill_tp=2, decode_tp=1, decode_workers=1,
                                       transport="grpc")) as coordinator:
        assert len(coordinator.workers["prefill-0"].rank_pids) == 2
        assert coordinator.workers["decode-0"].kv_address.lane_heads == ((0, 2),)  # one rank: lanes for the group
        first, second = serve_waves(coordinator, [wave1, wave2], max_tokens=6, groups=["prefill-0"])
        assert asyncio.run(wait_until_idle(coordinator))["prefill-0"].lane_transfers == 6
    assert [tokens for tokens, _ in first] == hf_greedy(checkpoint, wave1, 6)
    assert [tokens for tokens, _ in second] == hf_greedy(checkpoint, wave2, 6)
    assert [last.timing.decode_cached_tokens for _, last in second] == [32, 32]


def test_decode_groups_of_2_ranks_take_kv_and_a_killed_rank_migrates(checkpoint, hf_greedy):
    """From one rank, its heads split over each group's ranks by lanes (counted by the prefill worker). (Groups of
    one size, rank to rank: tests/cluster/multinode/test_tp_multinode.py, and tests/kv_transfer/test_lanes.py.)"""
    wave1, wave2 = two_waves(seed=41)
    prompts = random_prompts([20, 21, 22, 23], VOCAB, seed=42)
    with running_cluster(disagg_config(checkpoint, prefill_tp=1, decode_tp=2, decode_workers=2,
                                       transport="gloo")) as coordinator:
        assert all(len(coordinator.workers[name].kv_address.lanes) == 2 for name in ("decode-0", "decode-1"))
        first, second = serve_waves(coordinator, [wave1, wave2], max_tokens=6, groups=["decode-0", "decode-1"])
        lane_transfers = asyncio.run(wait_until_idle(coordinator))["prefill-0"].lane_transfers
        assert lane_transfers == 6
        victim = coordinator.workers["decode-1"]
        assert len(victim.rank_pids) == 2
        generations = [request(f"k{i}", p, greedy(KILLED_TOKENS)) for i, p in enumerate(prompts)]
        results, health = asyncio.run(kill_under_load(coordinator, generations,
                                                      lambda: os.kill(victim.rank_pids[1], signal.SIGKILL)))
        assert not wait_gone(victim.rank_pids), "a rank of the lost decode group is still running"
        assert_actors(["DecodeActor", "PrefillActor", "TPRankActor"])  # decode-0 (and its follower), prefill-0
    assert [tokens for tokens, _ in first] == hf_greedy(checkpoint, wave1, 6)
    assert [tokens for tokens, _ in second] == hf_greedy(checkpoint, wave2, 6)
    assert all(last.timing.decode_cached_tokens == 32 for _, last in second)
    assert [tokens for tokens, _ in results] == hf_greedy(checkpoint, prompts, KILLED_TOKENS)
    assert {last.timing.decode_worker for _, last in results} == {"decode-0"}
    assert sum(last.timing.migrations for _, last in results) >= 1
    assert health.details["dead_workers"] == ["decode-1"]
