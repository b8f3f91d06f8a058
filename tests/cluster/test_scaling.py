"""Workers added and drained while serving, on a real local Ray: disaggregated (gloo KV, so an added prefill
worker must be wired into every decode worker's receiver) and colocated replicas; the admin route, `tandem
scale` and /metrics; the autoscaler under a load that rises and falls.

Every request's tokens equal the colocated engine's greedy output and none fails; a drained worker finishes
what it holds before it stops (past the drain timeout, what it holds migrates), then its process is gone and
its own placement group removed; every pool ends whole; no process of the module's Ray outlives it.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses

import aiohttp
import pytest
import ray

from cluster.api.http_server import HttpServerConfig, start_http_server
from cluster.api.metrics import ServingMetrics
from cluster.backend import BackendUnavailable, ScaleRefused
from cluster.clients.scale import add_arguments as add_scale_arguments
from cluster.clients.scale import run as run_scale
from cluster.coordinator.autoscaler import AutoscalePolicy
from cluster.workers.worker_bounds import WorkerBounds
from engine import LLM
from tests.support.cluster_rig import POOL_BYTES, cluster_config, greedy, running_cluster, wait_until_idle
from tests.support.engine_checks import random_prompts
from tests.support.http_rig import post
from tests.support.scaling_rig import (PARAMS, finish, released, samples, victim, wait_for, wave,
                                       whereabouts, workers_in)

VOCAB = 256
KEY = "scale-s3cret"
PROMPTS = [tuple(p) for p in random_prompts([9, 300, 17, 280, 40, 5, 64, 23], VOCAB, seed=21)]
HOLD = greedy(1500)   # a request that keeps its worker busy until the test cancels it


@pytest.fixture(scope="module")
def disaggregated():
    config = dataclasses.replace(cluster_config(1, 1, "gloo"), bounds=WorkerBounds(max_prefill=2, max_decode=2),
                                 max_live_per_decode_worker=12)
    with running_cluster(config) as coordinator:
        yield coordinator


@pytest.fixture(scope="module")
def replicas():
    with running_cluster(dataclasses.replace(cluster_config(1, 1), num_prefill_workers=0, transport="auto")) \
            as coordinator:
        yield coordinator


@pytest.fixture(scope="module")
def colocated() -> LLM:
    return LLM("tiny", kv_cache_memory=POOL_BYTES)


@pytest.fixture(scope="module")
def oracle(colocated) -> dict[tuple[int, ...], list[int]]:
    outs = colocated.generate(prompt_token_ids=[list(p) for p in PROMPTS], sampling_params=PARAMS, use_tqdm=False)
    return {p: out.outputs[0].token_ids for p, out in zip(PROMPTS, outs)}


def test_disaggregated_workers_added_and_drained_while_requests_stream(disaggregated, oracle):
    coordinator = disaggregated

    async def run():
        decoding = asyncio.Queue()
        requests = wave(coordinator, "first", PROMPTS[0:3:2], decoding)   # two short prompts
        await decoding.get()
        assert (await coordinator.scaling.scale("decode", 1))["started"] == ["decode-1"]
        assert (await coordinator.scaling.scale("prefill", 1))["started"] == ["prefill-1"]
        second = wave(coordinator, "second", PROMPTS[1:4:2], decoding)   # two long prompts at once
        for _ in range(3):
            await decoding.get()
        running = whereabouts(coordinator)
        drained = [victim(await coordinator.scaling.scale(role, -1)) for role in ("decode", "prefill")]
        gone = [running[name] for name in drained]
        third = wave(coordinator, "third", PROMPTS[4:])
        lasts = await finish(coordinator, requests + second + third, oracle)
        return drained, gone, lasts

    drained, gone, lasts = asyncio.run(run())
    second, third = lasts[2:4], lasts[4:]
    assert {t.timing.decode_worker for t in second} == {"decode-0", "decode-1"}     # the added ones served
    assert {t.timing.prefill_worker for t in second} == {"prefill-0", "prefill-1"}
    assert not {w for t in third for w in (t.timing.decode_worker, t.timing.prefill_worker)} & set(drained)
    released(gone)
    assert len(workers_in(coordinator, "decode")) == len(workers_in(coordinator, "prefill")) == 1


def scale_command(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_scale_arguments(parser)
    return parser.parse_args(list(flags))


BAD_CHANGES = [({"role": "replica", "delta": 1}, "role"), ({"role": "gpu", "delta": 1}, "role"),
               ({"role": 3, "delta": 1}, "role"), ({"delta": 1}, "role"), ({"role": "decode", "delta": 0}, "delta"),
               ({"role": "decode", "delta": "1"}, "delta"), ({"role": "decode", "delta": 1.0}, "delta"),
               ({"role": "decode", "delta": True}, "delta"), ({"role": "decode", "delta": 1, "node": "a"}, "node"),
               ({"role": "decode", "delta": -1}, "delta"),      # below the minimum: 1 decode worker
               ({"role": "prefill", "delta": 2}, "delta")]      # above --max-prefill-workers 2


def test_admin_route_refuses_without_changing_anything_and_tandem_scale_changes(disaggregated, capsys):
    coordinator, auth = disaggregated, {"Authorization": f"Bearer {KEY}"}
    before = coordinator.scaling.describe()

    async def run():
        runner, port = await start_http_server(coordinator, HttpServerConfig(api_key=KEY), scaling=coordinator.scaling)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession(url) as session:
                for headers in (None, {"Authorization": "Bearer nope"}):
                    status, answer = await post(session, "/admin/workers", {"role": "decode", "delta": 1}, headers)
                    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
                for body, field in [*BAD_CHANGES, (b"{not json", None)]:
                    status, answer = await post(session, "/admin/workers", body, auth)
                    assert status == 400 and answer["error"]["param"] == field, (body, answer)
                async with session.get("/admin/workers", headers=auth) as response:
                    assert response.status == 200 and await response.json() == before == coordinator.scaling.describe()
                return await drain_through_tandem_scale(coordinator, session, url)
        finally:
            await runner.cleanup()

    name, gone, metrics = asyncio.run(run())
    released([gone])
    out, err = capsys.readouterr()
    assert "started: decode-" in out and f"draining: {name}" in out and "below the minimum" in err
    counts = {labels: value for labels, value in samples(metrics, "tandem_workers").items() if value}
    assert counts == {(("role", "decode"), ("state", "draining")): 1, (("role", "decode"), ("state", "serving")): 1,
                      (("role", "prefill"), ("state", "serving")): 1}
    assert samples(metrics, "tandem_worker_state")[(("role", "decode"), ("state", "draining"), ("worker", name))] == 1


async def drain_through_tandem_scale(coordinator, session, url: str):
    """`tandem scale` adds a decode worker, then drains one of the two while each holds a request, and a
    third call (one too many) is refused. Returns the drained worker's name, (pid, slot), and /metrics
    while it drained."""
    flags = ["--base-url", url, "--api-key", KEY, "--role", "decode"]
    assert await asyncio.to_thread(run_scale, scale_command(*flags, "--delta", "1")) == 0
    decoding = asyncio.Queue()
    holders = wave(coordinator, "hold", PROMPTS[0:3:2], decoding, HOLD)   # one on each decode worker
    await decoding.get()
    await decoding.get()
    running = whereabouts(coordinator)
    assert await asyncio.to_thread(run_scale, scale_command(*flags, "--delta", "-1")) == 0
    (name,) = workers_in(coordinator, "decode", "draining")
    gone = running[name]
    async with session.get("/metrics") as response:
        metrics = await response.text()
    assert await asyncio.to_thread(run_scale, scale_command(*flags, "--delta", "-1")) == 1
    for _, task in holders:   # the holders end (cancelled): the drained worker stops
        task.cancel()
    await asyncio.gather(*(task for _, task in holders), return_exceptions=True)
    await coordinator.scaling.settled()
    await wait_until_idle(coordinator)
    return name, gone, metrics


def test_replicas_added_and_drained_while_requests_stream(replicas, oracle):
    async def run():
        with pytest.raises(ScaleRefused, match="more than the Ray cluster can hold") as refused:
            await replicas.scaling.scale("replica", 20)
        assert refused.value.field == "delta" and workers_in(replicas, "replica") == ["replica-0"]
        decoding = asyncio.Queue()
        first = wave(replicas, "first", PROMPTS[:3], decoding)
        await decoding.get()
        assert (await replicas.scaling.scale("replica", 1))["started"] == ["replica-1"]
        second = wave(replicas, "second", PROMPTS[3:6], decoding)
        for _ in range(2 + 3):
            await decoding.get()
        running = whereabouts(replicas)
        name = victim(await replicas.scaling.scale("replica", -1))
        gone = running[name]
        third = wave(replicas, "third", PROMPTS[6:])
        return name, gone, await finish(replicas, first + second + third, oracle)

    name, gone, lasts = asyncio.run(run())
    assert "replica-1" in {last.timing.decode_worker for last in lasts[3:6]}
    assert name not in {last.timing.decode_worker for last in lasts[6:]}
    released([gone])
    assert len(workers_in(replicas, "replica")) == 1


def test_a_drain_past_its_timeout_moves_what_is_left_to_the_other_workers(replicas, colocated):
    """With a drain timeout shorter than a request, the drained replica is declared lost and its request
    migrates: it ends on the other replica with the colocated engine's tokens all the same."""
    scaling, params = replicas.scaling, greedy(64)
    outs = colocated.generate(prompt_token_ids=[list(p) for p in PROMPTS[4:6]], sampling_params=params, use_tqdm=False)
    unbounded = scaling._config
    scaling._config = dataclasses.replace(unbounded, drain_timeout_s=0.01)

    async def run():
        await scaling.scale("replica", 1)
        decoding = asyncio.Queue()
        requests = wave(replicas, "late", PROMPTS[4:6], decoding, params)   # one on each replica
        await decoding.get()
        await decoding.get()
        name = victim(await scaling.scale("replica", -1))
        results = await asyncio.gather(*(task for _, task in requests))
        await scaling.settled()
        await wait_until_idle(replicas)
        return name, results, await replicas.health()

    try:
        name, results, health = asyncio.run(run())
    finally:
        scaling._config = unbounded
    assert [tokens for tokens, _ in results] == [out.outputs[0].token_ids for out in outs]
    assert sorted(last.timing.migrations for _, last in results) == [0, 1]
    assert "drain ran past" in health.details["worker_failures"][name] and len(workers_in(replicas, "replica")) == 1


def test_an_added_worker_follows_the_placement_strategy_on_the_one_node_of_a_local_ray(disaggregated):
    """The same cluster with STRICT_SPREAD as its strategy: its only node holds workers, so one prefill worker
    more than the free start-group bundles (placed by the start group's rule) is refused before anything
    starts (PACK added one above); with a maximum that check is skipped, and the added worker's group, pinned
    away from that node, waits worker_start_timeout_s and is removed."""
    scaling, packed = disaggregated.scaling, disaggregated.scaling._config
    before, groups = scaling.describe(), live_groups()
    assert not scaling._set.failures()   # no lost worker whose start-group bundle a scale call would free
    delta = scaling._set.held_bundles(free=True).count("prefill") + 1
    serving = len(workers_in(disaggregated, "prefill"))

    async def run():
        scaling._config = dataclasses.replace(packed, placement_strategy="STRICT_SPREAD", bounds=WorkerBounds())
        with pytest.raises(ScaleRefused, match="STRICT_SPREAD puts every worker on a node of its own: 1 more "
                                               r"prefill worker\(s\) need 1 node\(s\) that hold none"):
            await scaling.scale("prefill", delta)
        scaling._config = dataclasses.replace(scaling._config, bounds=WorkerBounds(max_prefill=serving + delta),
                                              worker_start_timeout_s=2.0)
        with pytest.raises(BackendUnavailable, match="nothing changed: Ray could not place 1 workers .* within 2s"
                                                     ".* STRICT_SPREAD: on a node that holds none"):
            await scaling.scale("prefill", delta)

    try:
        asyncio.run(run())
    finally:
        scaling._config = packed
    assert scaling.describe() == before and live_groups() == groups


def live_groups() -> list[str]:
    return sorted(g["placement_group_id"] for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED")


def test_the_autoscaler_adds_a_decode_worker_under_load_and_drains_it_after(disaggregated, oracle):
    """Occupancy is the signal here (10 requests in flight of the 12 a decode worker holds, against 0.5);
    the latency SLOs and the prefill queue are set out of reach."""
    coordinator = disaggregated
    policy = AutoscalePolicy(interval_s=0.25, cooldown_s=0.5, window_s=5.0, ttft_slo_ms=1e7, itl_slo_ms=1e7,
                             prefill_queue_tokens=10 ** 9, decode_occupancy=0.5, up_ticks=1, down_ticks=4)

    async def load(requests: list, in_flight: int, until) -> None:
        while not until():
            for _ in range(in_flight - sum(not task.done() for _, task in requests)):
                prompt = PROMPTS[len(requests) % len(PROMPTS)]
                requests += wave(coordinator, f"load{len(requests)}-", [prompt])
            await asyncio.sleep(0.005)

    async def run():
        autoscaler = coordinator.scaling.start_autoscaler(policy)
        requests: list = []
        try:
            rising = asyncio.ensure_future(load(requests, 10, lambda: len(workers_in(coordinator, "decode")) == 2))
            await wait_for(rising.done, "a decode worker added under load")
            more = len(requests) + 20
            await load(requests, 10, lambda: len(requests) >= more)     # serving on two under the same load
            assert len(workers_in(coordinator, "decode")) == 2
            await wait_for(lambda: len(workers_in(coordinator, "decode")) == 1
                           and not workers_in(coordinator, "decode", "draining"), "back to one decode worker")
            await finish(coordinator, requests, oracle)
            return dict(autoscaler.decisions), ServingMetrics().render(await coordinator.health()).decode()
        finally:
            coordinator.scaling.stop_autoscaler()

    decisions, metrics = asyncio.run(run())
    assert decisions == {("decode", "add", "applied"): 1, ("decode", "drain", "applied"): 1}
    assert samples(metrics, "tandem_autoscale_decisions_total") == {
        (("action", "add"), ("outcome", "applied"), ("role", "decode")): 1,
        (("action", "drain"), ("outcome", "applied"), ("role", "decode")): 1}
    assert samples(metrics, "tandem_workers")[(("role", "decode"), ("state", "serving"))] == 1
