"""Prefill worker faults in disaggregated serving. (The killed *decode* worker is in
test_cluster_coordinator.py.)

On a real local Ray (KV over gRPC on 127.0.0.1), 3 prefill + 1 decode workers, killed one by one with
ray.kill: a prefill worker killed while requests are queued and prefilling on it, then one killed while
idle (the coordinator learns it only when a request is routed there), then the last one. A request whose
prefill worker dies before it delivered anything starts over on a survivor, so clients see exact output
(equal to a colocated engine) until no prefill worker is left; then WorkerLost, then BackendUnavailable
at once. The coordinator stops routing to each dead worker, and the survivors, decode worker included
(it had accepted, and may have received KV for, the dead workers' requests), end with every block free.

Without Ray, with fake actors: how a RequestFlow takes its prefill worker's death before and after the
request's KV landed on the decode worker.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
import ray
from ray.exceptions import RayActorError

from cluster.backend import BackendUnavailable
from cluster.coordinator.request_flow import FlowHooks, RequestFlow, WorkerLost, WorkerRef
from decode_worker import DecodeChunk
from engine import LLM
from tests.support.cluster_rig import (SMALL_ENGINE, cluster_config, collect, greedy, request, running_cluster,
                                       wait_until_idle)
from tests.support.engine_checks import random_prompts

VOCAB = 256               # byte ids of the default model's tokenizer
PROMPT_TOKENS = 400       # 25 blocks; at 16 tokens a step, each prompt takes 25 prefill steps
MAX_TOKENS = 4
# Small steps make each prefill long, so that the victim still holds requests when it is killed.
FAULT_ENGINE = dataclasses.replace(SMALL_ENGINE, max_num_batched_tokens=16)
COORDINATOR_LOG = "tandem.cluster.coordinator"


@pytest.fixture(scope="module")
def three_by_one():
    with running_cluster(dataclasses.replace(cluster_config(3, 1), engine=FAULT_ENGINE)) as coordinator:
        yield coordinator


@pytest.fixture(scope="module")
def colocated() -> LLM:
    return LLM("tiny", kv_cache_memory=SMALL_ENGINE.kv_cache_memory)


def expected_tokens(colocated: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = colocated.generate(prompt_token_ids=prompts, sampling_params=greedy(MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


async def holding(actor, min_live: int) -> None:
    """Returns once the prefill worker `actor` holds at least `min_live` tasks (queued, prefilling or
    shipping)."""
    while (await actor.stats.remote()).live_requests < min_live:
        await asyncio.sleep(0.005)


async def generate_all(coordinator, prefix: str, prompts: list[list[int]]) -> list:
    return await asyncio.gather(*(collect(coordinator, request(f"{prefix}{i}", p, greedy(MAX_TOKENS)))
                                  for i, p in enumerate(prompts)))


def test_killed_prefill_workers_requests_start_over_on_the_survivors(three_by_one, colocated, caplog):
    busy = random_prompts([PROMPT_TOKENS] * 6, VOCAB, seed=21)    # equal lengths: 2 on each prefill worker
    idle = random_prompts([PROMPT_TOKENS, PROMPT_TOKENS], VOCAB, seed=22)  # 1 on prefill-0, 1 on prefill-2
    busy_expected, idle_expected = expected_tokens(colocated, busy), expected_tokens(colocated, idle)
    actors = {name: worker.actor for name, worker in three_by_one._workers.items()}

    async def kill_busy_then_idle():
        runs = asyncio.ensure_future(generate_all(three_by_one, "busy", busy))
        await asyncio.wait_for(holding(actors["prefill-1"], min_live=2), 60)  # 1 prefilling, 1 queued
        ray.kill(actors["prefill-1"])
        busy_results = await runs
        ray.kill(actors["prefill-2"])  # idle: nothing tells the coordinator until a request goes there
        return busy_results, await generate_all(three_by_one, "idle", idle), await wait_until_idle(three_by_one)

    with caplog.at_level(logging.WARNING, logger=COORDINATOR_LOG):
        busy_results, idle_results, stats = asyncio.run(kill_busy_then_idle())
    assert [tokens for tokens, _ in busy_results] == busy_expected
    assert [tokens for tokens, _ in idle_results] == idle_expected
    assert all(last.finish_reason == "length" for _, last in busy_results + idle_results)
    assert all(last.timing.prefill_worker == "prefill-0" for _, last in idle_results)
    restarts = [r.getMessage() for r in caplog.records if "continues on the surviving workers" in r.getMessage()]
    assert any("prefill worker prefill-1 died" in m for m in restarts)
    assert any("prefill worker prefill-2 died" in m for m in restarts)
    assert not three_by_one.is_alive("prefill-1") and not three_by_one.is_alive("prefill-2")
    assert set(stats) == {"prefill-0", "decode-0"}  # both idle, every block free (wait_until_idle)


def test_with_no_prefill_worker_left_requests_fail(three_by_one):
    prompt = random_prompts([30], VOCAB, seed=23)[0]

    async def kill_the_last():
        ray.kill(three_by_one._workers["prefill-0"].actor)
        with pytest.raises(WorkerLost, match="prefill worker prefill-0 died") as lost:
            await collect(three_by_one, request("last", prompt, greedy(MAX_TOKENS)))
        with pytest.raises(BackendUnavailable, match="no prefill worker is alive"):
            await collect(three_by_one, request("none", prompt, greedy(MAX_TOKENS)))
        return lost.value, await three_by_one.health(), await wait_until_idle(three_by_one)

    lost, health, stats = asyncio.run(kill_the_last())
    assert lost.role == "prefill" and isinstance(lost, BackendUnavailable)
    assert set(stats) == {"decode-0"}  # it freed what it had accepted for "last"
    assert not health.serving and health.prefill_workers == 0 and health.decode_workers == 1
    assert health.details["dead_workers"] == ["prefill-0", "prefill-1", "prefill-2"]


# ---- RequestFlow with fake actors ------------------------------------------------------------------

class _Method:
    def __init__(self, call) -> None:
        self.remote = call


class _FakeActors:
    """A prefill actor whose one report is `self.report` (a future the test resolves) and a decode
    actor whose event-stream mailbox is `self.events` (the test puts the events); both record cancels."""

    def __init__(self) -> None:
        self.report: asyncio.Future = asyncio.get_running_loop().create_future()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled: list[tuple[str, str]] = []
        self.lost: list[str] = []
        self.prefill = WorkerRef("p", self._actor("p", prefill=_Method(lambda task: self.report)))
        self.decode = WorkerRef("d", self._actor("d"))

    def _actor(self, name: str, **methods):
        cancel = _Method(lambda request_id: self.cancelled.append((name, request_id)))
        return type("FakeActor", (), {"cancel": cancel, **methods})()

    def flow(self) -> RequestFlow:
        hooks = FlowHooks(self.lost.append, lambda name: name not in self.lost, lambda: None)
        return RequestFlow(request("r", [1, 2, 3], greedy(2)), "r#0", self.prefill, self.decode, None,
                           self.events, hooks)


def test_prefill_death_after_the_kv_landed_does_not_end_the_request():
    async def scenario():
        fake = _FakeActors()
        chunks = fake.flow().chunks()
        fake.events.put_nowait(DecodeChunk("r#0", (7,), "a"))
        first = await anext(chunks)
        fake.report.set_exception(RayActorError())
        fake.events.put_nowait(DecodeChunk("r#0", (8,), "b", "length"))
        rest = [chunk async for chunk in chunks]
        return fake, [first] + rest

    fake, chunks = asyncio.run(scenario())
    assert [c.token_ids for c in chunks] == [(7,), (8,)] and chunks[-1].finish_reason == "length"
    timing = chunks[-1].timing
    assert timing.prefill_ms == timing.transfer_ms == timing.kv_bytes == 0 and timing.ttft_ms > 0
    assert fake.lost == ["p"] and fake.cancelled == []


def test_prefill_death_before_the_kv_landed_is_worker_lost_and_cancels_the_decode_side():
    async def scenario():
        fake = _FakeActors()
        fake.report.set_exception(RayActorError())
        with pytest.raises(WorkerLost, match="prefill worker p died") as lost:
            async for _ in fake.flow().chunks():
                pass
        return fake, lost.value

    fake, lost = asyncio.run(scenario())
    assert lost.role == "prefill" and fake.lost == ["p"] and fake.cancelled == [("d", "r#0")]
