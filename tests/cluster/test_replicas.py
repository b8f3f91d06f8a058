"""Colocated replicas (`tandem serve --replicas N`) on a real local Ray: 2 replica actors, each a decode
worker that prefills every prompt itself (chunked), behind the Coordinator; no prefill worker, no KV moved.

Greedy output equals the in-process engine's for short and long (chunked) prompts mixed, and a running
decode keeps streaming while a long prompt is prefilled beside it; prompts sharing a prefix go to the same
replica; /health and /metrics say "replica"; a cancel frees everything; a SIGKILLed replica's requests
migrate to the other token for token, and with none left the error says so. Every test ends with every
alive replica's pool whole.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import queue
import signal
import time
from contextlib import aclosing

import pytest

from cluster.api.metrics import ServingMetrics
from cluster.coordinator.request_flow import WorkerLost
from cluster.serve import add_arguments
from cluster.serve import cluster_config as serve_cluster_config
from cluster.serve import config_from_args
from decode_worker import DecodeEnded, DecodeStatus, DecodeWorker, DecodeWorkerConfig, ExpectedRequest
from decode_worker.no_receiver import NO_TRANSPORT
from engine import LLM, EngineConfig, SamplingParams
from tests.support.cluster_rig import (POOL_BYTES, cluster_config, collect, greedy, kill_under_load, request,
                                       running_cluster, wait_until_idle)
from tests.support.engine_checks import random_prompts
from tests.support.serve_process import descendants

VOCAB = 256
CHUNK = 32  # the token budget of a step: a 600-token prompt is prefilled in ~19 chunks
ENGINE = EngineConfig(kv_cache_memory=POOL_BYTES, max_num_batched_tokens=CHUNK)


@pytest.fixture(scope="module")
def replicas():
    """The 2 replicas, processes below this one; at the end every process they started must be gone
    (running_cluster checks)."""
    config = dataclasses.replace(cluster_config(1, 2), num_prefill_workers=0, transport="auto", engine=ENGINE)
    with running_cluster(config) as coordinator:
        assert {info.pid for info in coordinator.workers.values()} <= descendants(os.getpid())
        yield coordinator


@pytest.fixture(scope="module")
def in_process() -> LLM:
    return LLM("tiny", kv_cache_memory=POOL_BYTES, max_num_batched_tokens=CHUNK)


def expected_tokens(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outs]


def test_replicas_flag_combinations():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--replicas", "3", "--cpu-threads", "2"]))
    assert (config.mode, config.replicas, config.prefill_workers, config.decode_workers) == ("colocated", 3, 0, 3)
    cluster = serve_cluster_config(config)
    assert cluster.replicas and cluster.decode_role == "replica" and cluster.cpu_threads_per_worker == 2
    assert config_from_args(parser.parse_args([])).replicas == 0          # the in-process engine
    for flags, match in ((["--replicas", "2", "--prefill-workers", "1"], "no --prefill-workers"),
                         (["--mode", "disaggregated", "--replicas", "2"], "not --mode disaggregated"),
                         (["--replicas", "2", "--decode-workers", "2"], "no --prefill-workers or --decode-workers"),
                         (["--replicas", "-1"], "--replicas must be >= 0"),
                         (["--replicas", "2", "--transport", "grpc"], "move no KV"),
                         (["--replicas", "2", "--local-prefill-tokens", "64"], "needs --mode disaggregated"),
                         (["--address", "10.0.0.1:6379"], "or --replicas N")):
        with pytest.raises(ValueError, match=match):
            config_from_args(parser.parse_args(flags))


def test_a_replica_is_a_decode_worker_without_a_kv_receiver(in_process):
    """Bare, without Ray: transport "none" opens no KV port; it prefills what it is given to prefill itself
    (and equals the in-process engine), refuses to wait for KV that can never come, and ends with its pool
    whole and its threads stopped."""
    prompt = tuple(random_prompts([40], VOCAB, seed=2)[0])
    worker = DecodeWorker(LLM("tiny", kv_cache_memory=POOL_BYTES, max_num_batched_tokens=CHUNK).engine,
                          DecodeWorkerConfig("replica-t", NO_TRANSPORT))
    try:
        assert worker.address is None
        events: queue.Queue = queue.Queue()
        assert worker.expect(ExpectedRequest("local", prompt, greedy(5), prefill_locally=True), events.put).accepted
        assert worker.expect(ExpectedRequest("remote", prompt, greedy(5)), events.put).accepted
        received, ended = [], {}
        while len(ended) < 2:
            event = events.get(timeout=30)
            if isinstance(event, DecodeEnded):
                ended[event.request_id] = event
            else:
                received += event.token_ids if event.request_id == "local" else []
                if event.finish_reason is not None:
                    ended[event.request_id] = event
        assert received == expected_tokens(in_process, [list(prompt)], greedy(5))[0]
        assert ended["remote"].status is DecodeStatus.INVALID and "receives no KV" in ended["remote"].message
        deadline = time.monotonic() + 10  # the step thread publishes its stats after the step's events
        while (stats := worker.stats()).running or stats.free_blocks != stats.total_blocks:
            assert time.monotonic() < deadline, f"the replica still holds requests or blocks: {stats}"
            time.sleep(0.01)
        assert stats.waiting == stats.engine_requests == 0
    finally:
        worker.stop()
    assert not worker.alive


def test_short_and_long_prompts_mixed_equal_the_in_process_engine(replicas, in_process):
    prompts = random_prompts([1, 5, 17, 40, 400, 3, 90, 12, 33, 64], VOCAB, seed=21)
    params = greedy(8)
    expected = expected_tokens(in_process, prompts, params)

    async def run_all():
        results = await asyncio.gather(*(collect(replicas, request(f"m{i}", p, params))
                                         for i, p in enumerate(prompts)))
        await wait_until_idle(replicas)
        return results

    results = asyncio.run(run_all())
    assert [tokens for tokens, _ in results] == expected
    for _, last in results:
        timing = last.timing
        assert last.finish_reason == "length" and timing.ttft_ms > 0 and timing.migrations == 0
        assert (timing.prefill_worker, timing.transfer_ms, timing.kv_bytes) == ("", 0, 0)
    assert {last.timing.decode_worker for _, last in results} == {"replica-0", "replica-1"}  # by load


def test_decode_keeps_streaming_while_a_long_prompt_prefills_in_chunks(replicas, in_process):
    """A decodes; L (its prefix + 600 tokens) goes to A's replica (prefix affinity) and is prefilled there
    in 32-token chunks, each in a step with A's next token: A streams on meanwhile."""
    prefix, tails = random_prompts([48], VOCAB, seed=5)[0], random_prompts([4, 600], VOCAB, seed=6)
    decoding, long_prompt = prefix + tails[0], prefix + tails[1]
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    expected = expected_tokens(in_process, [decoding, long_prompt], [params, greedy(4)])

    async def run():
        tokens, times, last, long_run = [], [], None, None
        async with aclosing(replicas.generate(request("A", decoding, params))) as chunks:
            async for last in chunks:
                tokens += last.token_ids
                times += [time.perf_counter()] * len(last.token_ids)
                if long_run is None:  # A decodes: L arrives now
                    long_request = request("L", long_prompt, greedy(4))
                    long_run = asyncio.ensure_future(collect(replicas, long_request))
        long_tokens, long_last = await long_run
        await wait_until_idle(replicas)
        return tokens, last, long_tokens, long_last, long_request.arrival_time, times

    tokens, last, long_tokens, long_last, arrived, times = asyncio.run(run())
    assert [tokens, long_tokens] == expected
    assert long_last.timing.decode_worker == last.timing.decode_worker
    first_long_token = arrived + long_last.timing.ttft_ms / 1e3
    during = [t for t in times if arrived < t < first_long_token]
    assert len(during) >= 5, f"A got {len(during)} tokens while L's 600 tokens were prefilled"


def test_prompts_sharing_a_prefix_go_to_the_same_replica(replicas, in_process):
    shared = random_prompts([64, 64], VOCAB, seed=8)
    tails = random_prompts([3, 9, 14, 5, 11, 7], VOCAB, seed=9)
    prompts = [shared[i % 2] + tail for i, tail in enumerate(tails)]  # interleaved: P0, P1, P0, P1, ...
    params = greedy(6)
    expected = expected_tokens(in_process, prompts, params)

    async def run():
        together = await asyncio.gather(*(collect(replicas, request(f"p{i}", p, params))
                                          for i, p in enumerate(prompts)))
        alone = await collect(replicas, request("p-late", shared[1] + [1, 2, 3], params))  # an idle cluster
        await wait_until_idle(replicas)
        return together, alone

    together, alone = asyncio.run(run())
    assert [tokens for tokens, _ in together] == expected
    placed = [last.timing.decode_worker for _, last in together]
    assert len({placed[0], placed[2], placed[4]}) == 1 and len({placed[1], placed[3], placed[5]}) == 1
    assert placed[0] != placed[1]                                           # two prefixes, two replicas
    assert alone[1].timing.decode_worker == placed[1]


def test_health_and_metrics_name_the_replicas(replicas):
    async def run():
        return await replicas.health()

    health = asyncio.run(run())
    assert health.serving and (health.prefill_workers, health.decode_workers) == (0, 2)
    assert health.details["mode"] == "replicas" and health.details["total_kv_blocks"] > 0
    assert {name: load["role"] for name, load in health.details["workers"].items()} == \
        {"replica-0": "replica", "replica-1": "replica"}
    metrics = ServingMetrics().render(health).decode()
    assert 'tandem_worker_kv_total_blocks{role="replica",worker="replica-1"}' in metrics
    assert replicas.workers["replica-0"].kv_address is None                 # no KV port is open


def test_cancel_mid_stream_frees_everything(replicas):
    async def run():
        long_run = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        seen = 0
        async with aclosing(replicas.generate(request("cut", random_prompts([70], VOCAB, 3)[0], long_run))) as chunks:
            async for chunk in chunks:
                seen += len(chunk.token_ids)
                if seen >= 3:
                    break
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(replicas, request("bad", [1, 10_000], greedy(4)))
        await wait_until_idle(replicas)
        return seen

    assert asyncio.run(run()) >= 3


def test_a_killed_replicas_requests_migrate_token_for_token(replicas, in_process):
    """Last in this module: SIGKILL of replica-1 while four requests decode, two on each replica; the two
    on it continue on replica-0 as prompt + streamed tokens, every client gets the in-process engine's
    tokens; then replica-0 dies too and the error says no replica is left."""
    prompts = random_prompts([20, 21, 22, 23], VOCAB, seed=10)
    params = greedy(200)
    expected = expected_tokens(in_process, prompts, params)
    victim = replicas.workers["replica-1"]

    generations = [request(f"k{i}", p, params) for i, p in enumerate(prompts)]
    results, health = asyncio.run(kill_under_load(replicas, generations, lambda: os.kill(victim.pid, signal.SIGKILL)))
    assert [tokens for tokens, _ in results] == expected
    assert [last.timing.decode_worker for _, last in results] == ["replica-0"] * 4
    assert sorted(last.timing.migrations for _, last in results) == [0, 0, 1, 1]
    assert health.serving and health.decode_workers == 1 and health.details["dead_workers"] == ["replica-1"]

    async def last_one_dies():
        first_chunks: asyncio.Queue = asyncio.Queue()
        run = asyncio.ensure_future(collect(replicas, request("k9", prompts[0], params), first_chunks))
        await asyncio.wait_for(first_chunks.get(), 60)
        os.kill(replicas.workers["replica-0"].pid, signal.SIGKILL)
        with pytest.raises(WorkerLost, match="no replica is left"):
            await run
        assert not (await replicas.health()).serving

    asyncio.run(last_one_dies())
