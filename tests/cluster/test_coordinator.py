"""Disaggregated serving on a real local Ray: prefill and decode workers in their own actor processes,
KV over real gRPC on 127.0.0.1, the Coordinator driving them from this process.

1 prefill + 1 decode: greedy output equals a colocated engine.LLM token for token, timing is filled in,
cancel frees everything, a KV sender from outside the cluster (no secret, or another one) is refused.
1 prefill + 2 decode: a killed decode worker's requests (and, in a cluster of their own, the n samples of
one request) migrate to the survivor and finish token for token. Every test ends with every alive worker's
pool empty.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from contextlib import aclosing

import pytest
import ray

from cluster.backend import BackendOverloaded, BackendUnavailable
from cluster.coordinator.request_flow import WorkerLost
from engine import LLM, SamplingParams
from kv_transfer import ModelFingerprint, SendRequest, TransferConfig, TransferStatus, create_sender
from kv_transfer.testing import FreeListPool
from tests.support.cluster_rig import (SMALL_ENGINE, cluster_config, collect, greedy, request, running_cluster,
                                       wait_until_idle, worker_running)
from tests.support.engine_checks import random_prompts
from tests.support.timing_checks import assert_remote_prefill_timing

VOCAB = 256  # byte ids of the default model's tokenizer


@pytest.fixture(scope="module")
def one_by_one():
    with running_cluster(cluster_config(1, 1)) as coordinator:
        yield coordinator


@pytest.fixture(scope="module")
def colocated() -> LLM:
    return LLM("tiny", kv_cache_memory=SMALL_ENGINE.kv_cache_memory)


def prompts_with_shared_prefixes(seed: int) -> list[list[int]]:
    lengths = [1, 5, 16, 17, 40, 3, 90, 33, 8, 64, 21, 2,
               7, 12, 25, 31, 47, 9, 4, 60, 15, 28, 11, 36, 6, 19, 44, 13, 26, 10]  # 32 with the two below
    prompts = random_prompts(lengths, VOCAB, seed=seed)
    prompts.append(prompts[6][:48] + prompts[1])     # shares 3 blocks with the 90-token prompt
    prompts.append(list(prompts[9]))                 # the 64-token prompt again
    return prompts


def test_each_worker_runs_torch_with_its_share_of_the_cores(one_by_one):
    """No thread count given: the host's cores shared evenly between the two workers, at least 1 each, as each
    worker's actor reports it from its own process."""
    share = max(1, (os.cpu_count() or 1) // 2)
    assert {name: info.torch_threads for name, info in one_by_one.workers.items()} == {"prefill-0": share,
                                                                                       "decode-0": share}


def test_greedy_equals_colocated_with_timing(one_by_one, colocated):
    prompts = prompts_with_shared_prefixes(seed=3)
    params = greedy(10)
    outs = colocated.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)

    async def run_all():
        results = await asyncio.gather(*(collect(one_by_one, request(f"g{i}", p, params))
                                         for i, p in enumerate(prompts)))
        await wait_until_idle(one_by_one)
        return results

    results = asyncio.run(run_all())
    for prompt, out, (tokens, last) in zip(prompts, outs, results):
        assert tokens == out.outputs[0].token_ids, f"prompt of {len(prompt)} tokens differs from colocated"
        timing = last.timing
        assert last.finish_reason == "length"
        assert_remote_prefill_timing(timing)
        assert (timing.prefill_worker, timing.decode_worker) == ("prefill-0", "decode-0")


def test_seeded_sampling_equals_colocated(one_by_one, colocated):
    """A seeded request's draw for position p depends on (seed, p) alone: the prefill worker samples the
    first token and the decode worker the rest, and the tokens are the colocated engine's."""
    prompts = random_prompts([7, 40], VOCAB, seed=8)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=40, seed=77, ignore_eos=True)
    outs = colocated.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)

    async def run_all():
        results = await asyncio.gather(*(collect(one_by_one, request(f"s{i}", p, params))
                                         for i, p in enumerate(prompts)))
        await wait_until_idle(one_by_one)
        return results

    for out, (tokens, last) in zip(outs, asyncio.run(run_all())):
        assert tokens == out.outputs[0].token_ids and last.timing.kv_bytes > 0


def test_past_the_prefill_queue_bound_requests_are_refused_as_overloaded(one_by_one):
    """With max_prefill_queue_tokens 500, of three concurrent 400-token prompts on one prefill worker the
    first is queued and served; a prompt that would pass the bound is refused (429), holding nothing."""
    prompts = random_prompts([400, 400, 400], VOCAB, seed=12)
    unbounded = one_by_one._config
    one_by_one._config = dataclasses.replace(unbounded, max_prefill_queue_tokens=500)

    async def run_all():
        results = await asyncio.gather(*(collect(one_by_one, request(f"q{i}", p, greedy(2)))
                                         for i, p in enumerate(prompts)), return_exceptions=True)
        await wait_until_idle(one_by_one)
        return results

    try:
        results = asyncio.run(run_all())
    finally:
        one_by_one._config = unbounded
    refused = [r for r in results if isinstance(r, BackendOverloaded)]
    served = [r for r in results if not isinstance(r, BaseException)]
    assert refused and served and len(refused) + len(served) == 3, results
    assert "prefill queues" in str(refused[0]) and all(len(tokens) == 2 for tokens, _ in served)


def test_first_token_that_ends_the_request_comes_from_the_prefill_worker(one_by_one, colocated):
    prompt = random_prompts([12], VOCAB, seed=5)[0]
    expected = colocated.generate(prompt_token_ids=[prompt], sampling_params=greedy(1), use_tqdm=False)

    async def run():
        result = await collect(one_by_one, request("one", prompt, greedy(1)))
        await wait_until_idle(one_by_one)
        return result

    tokens, last = asyncio.run(run())
    assert tokens == expected[0].outputs[0].token_ids and last.finish_reason == "length"
    assert last.timing.kv_bytes == 0 and last.timing.prefill_worker == "prefill-0"


def test_input_the_engine_rejects_is_a_value_error_and_frees_the_decode_side(one_by_one):
    async def run():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(one_by_one, request("bad", [1, 2, 10_000], greedy(4)))
        await wait_until_idle(one_by_one)

    asyncio.run(run())


def test_cancel_mid_stream_and_before_the_first_token_free_everything(one_by_one):
    prompts = random_prompts([30, 50], VOCAB, seed=7)
    long_run = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def read_two_chunks_then_leave():
        seen = 0
        async with aclosing(one_by_one.generate(request("mid", prompts[0], long_run))) as chunks:
            async for chunk in chunks:
                seen += len(chunk.token_ids)
                if seen >= 2:
                    break
        return seen

    async def leave_before_the_first_token(delay_s: float):  # routing, prefill or transfer under way
        chunks = one_by_one.generate(request(f"early-{delay_s}", prompts[1], long_run))
        first = asyncio.ensure_future(chunks.__anext__())
        await asyncio.sleep(delay_s)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await chunks.aclose()

    async def run():
        seen = await read_two_chunks_then_leave()
        for delay_s in (0.0, 0.001, 0.004, 0.01, 0.02):
            await leave_before_the_first_token(delay_s)
        await wait_until_idle(one_by_one)
        return seen

    assert asyncio.run(run()) >= 2


def test_kv_receivers_refuse_senders_from_outside_the_cluster(one_by_one):
    """start_cluster hands its workers a secret: a gRPC KV sender without it (another secret, or none) is
    refused UNAUTHENTICATED by decode-0's receiver, and the cluster keeps serving over the same receiver."""
    decode = one_by_one.workers["decode-0"]
    layout = ModelFingerprint(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", block_size=4)
    for secret in ("f" * 64, None):  # the stream is refused before its manifest (any layout) is read
        pool = FreeListPool(layout, 8)
        sender = create_sender(TransferConfig(transport="grpc", cluster_secret=secret), pool.view(), "grpc")
        pool.take((0, 1))
        handle = sender.send(decode.kv_address, SendRequest("outsider", (0, 1), 8, first_token=1))
        assert handle.exception(30).status == TransferStatus.UNAUTHENTICATED
        sender.close()
        assert pool.num_free == 8

    async def run():
        result = await collect(one_by_one, request("insider", random_prompts([20], VOCAB, seed=11)[0], greedy(4)))
        await wait_until_idle(one_by_one)  # every pool whole: nothing was allocated for the outsiders
        return result

    tokens, last = asyncio.run(run())
    assert len(tokens) == 4 and last.timing.kv_bytes > 0 and last.timing.decode_worker == "decode-0"


@pytest.fixture(scope="module")
def one_by_two():
    with running_cluster(cluster_config(1, 2)) as coordinator:
        yield coordinator


def test_killed_decode_workers_requests_migrate_and_finish_token_for_token(one_by_two, colocated):
    """SIGKILL of one of two decode workers' processes while all four requests decode: the two
    on it continue on the survivor as prompt + streamed tokens; every client gets the colocated engine's
    tokens (greedy, and seeded for k3), no error; the dead worker is no longer routed to."""
    prompts = random_prompts([20, 21, 22, 23], VOCAB, seed=9)
    params = greedy(300)  # long enough that all four still decode when decode-1 is killed
    seeded = SamplingParams(max_tokens=300, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    per_request = [params, params, params, seeded]  # k3, seeded, is on the worker that dies
    expected = [o.outputs[0].token_ids for o in colocated.generate(prompt_token_ids=prompts,
                                                                    sampling_params=per_request, use_tqdm=False)]
    victim = one_by_two.workers["decode-1"]

    def started(index: int, prompt: list[int], first_chunks: asyncio.Queue):
        return collect(one_by_two, request(f"k{index}", prompt, per_request[index % 4]), first_chunks)

    async def run():
        first_chunks: asyncio.Queue = asyncio.Queue()
        runs = [asyncio.ensure_future(started(i, p, first_chunks)) for i, p in enumerate(prompts)]
        for _ in prompts:  # every request is decoding (round robin: k0, k2 on decode-0; k1, k3 on decode-1)
            await asyncio.wait_for(first_chunks.get(), 30)
        os.kill(victim.pid, signal.SIGKILL)
        results = await asyncio.gather(*runs)
        after = await collect(one_by_two, request("after", prompts[0], greedy(8)))
        health = await one_by_two.health()
        await wait_until_idle(one_by_two)
        return results, after, health, await one_by_two.worker_stats()

    results, after, health, stats = asyncio.run(run())
    assert [tokens for tokens, _ in results] == expected
    assert [last.timing.decode_worker for _, last in results] == ["decode-0"] * 4
    assert [last.timing.migrations for _, last in results] == [0, 1, 0, 1]  # k1, k3 moved off decode-1
    assert all(last.finish_reason == "length" and last.timing.ttft_ms > 0 for _, last in results)
    assert after[1].timing.decode_worker == "decode-0" and len(after[0]) == 8
    assert victim.name not in stats and set(stats) == {"prefill-0", "decode-0"}
    assert health.serving and health.decode_workers == 1 and health.details["dead_workers"] == ["decode-1"]

    async def last_one_dies():  # with no decode worker left, the error says so
        first_chunks: asyncio.Queue = asyncio.Queue()
        run = asyncio.ensure_future(started(9, prompts[0], first_chunks))
        await asyncio.wait_for(first_chunks.get(), 30)
        ray.kill(one_by_two._workers["decode-0"].actor)
        with pytest.raises(WorkerLost, match="no decode worker is left") as lost:
            await run
        assert isinstance(lost.value, BackendUnavailable)
        with pytest.raises(BackendUnavailable):
            await collect(one_by_two, request("none", prompts[0], greedy(2)))

    asyncio.run(last_one_dies())


def test_n_samples_migrate_each_on_its_own_when_their_decode_worker_dies(colocated):
    """n=3 seeded samples share one decode worker (sample 0's KV shipped there, the others prefilled there
    from its cached blocks); SIGKILL of that worker while all three decode: each sample continues on the
    survivor and the client gets the colocated engine's three samples, token for token, no error."""
    prompt = random_prompts([40], VOCAB, seed=21)[0]
    params = SamplingParams(n=3, max_tokens=200, temperature=0.8, seed=5, ignore_eos=True)
    expected = [list(o.token_ids) for o in colocated.generate(prompt_token_ids=[prompt], sampling_params=params,
                                                               use_tqdm=False)[0].outputs]

    async def run():
        tokens, timings, killed = {0: [], 1: [], 2: []}, {}, None
        async with aclosing(coordinator.generate(request("n3", prompt, params))) as chunks:
            async for chunk in chunks:
                tokens[chunk.index] += chunk.token_ids
                if chunk.timing is not None:
                    timings[chunk.index] = chunk.timing
                if killed is None and all(tokens.values()):  # every sample decodes: kill their worker
                    killed = await worker_running(coordinator, 3)
                    os.kill(coordinator.workers[killed].pid, signal.SIGKILL)
        await wait_until_idle(coordinator)
        return tokens, timings, killed

    with running_cluster(cluster_config(1, 2)) as coordinator:
        tokens, timings, killed = asyncio.run(run())
    assert [tokens[j] for j in range(3)] == expected
    assert all(timings[j].migrations == 1 and timings[j].decode_worker != killed for j in range(3))
