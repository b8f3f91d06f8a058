"""Workers added and drained while serving on three Ray nodes of one machine (ray.cluster_utils.Cluster:
tests/support/fake_nodes.py, the one test_multinode.py ran on: conftest.py; node a is the prefill pool, b and c
the decode pool, 1 CPU each), by the cluster's placement strategy: STRICT_SPREAD with the role pools, KV over
gloo between the nodes, a tiny llama checkpoint built with transformers' save_pretrained, whose greedy output is
the oracle.

One cluster for the module: prefill-0 on a, decode-0 on b or c. An added decode worker lands on the third
node; both decode workers serve; a worker past the nodes is refused with nothing changed; on a fourth node
with room for two workers only one goes (a second is refused, or with a maximum its pinned group waits
worker_start_timeout_s and is removed); a decode worker drained while it streams fails no request, and one
added after it goes where the drained one was. The module ends with every pool whole, no actor, no
placement group and no worker process left.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest

from cluster.backend import BackendUnavailable, ScaleRefused
from cluster.coordinator.start import start_cluster
from cluster.workers.worker_bounds import WorkerBounds
from tests.support.cluster_rig import cluster_config, collect, greedy, request, wait_until_idle
from tests.support.engine_checks import random_prompts
from tests.support.fake_nodes import DECODE_POOL, NODE_IP, PREFILL_POOL, assert_released, live_placement_groups
from tests.support.scaling_rig import released, wait_gone, whereabouts, workers_in

LOAD_TIMEOUT_S = 120.0   # a bound on every wait for requests: nothing may hang


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def vocab(checkpoint) -> int:
    return json.loads((checkpoint / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def coordinator(fake, checkpoint):
    """1 prefill + 1 decode worker, STRICT_SPREAD, each role in its node pool, KV over gloo (the decode
    worker's control listener on its node's address). At the end: pools whole, then nothing of the workers left."""
    config = dataclasses.replace(cluster_config(1, 1, "gloo"), model=str(checkpoint), dtype="float32",
                                 placement_strategy="STRICT_SPREAD",
                                 prefill_resources={PREFILL_POOL: 1}, decode_resources={DECODE_POOL: 1})
    coordinator = start_cluster(config)
    pids = {info.pid for info in coordinator.workers.values()}
    yield coordinator
    asyncio.run(wait_until_idle(coordinator))
    pids |= {info.pid for info in coordinator.workers.values()}
    asyncio.run(coordinator.shutdown())
    assert_released(pids)


def nodes_of(fake, coordinator) -> dict[str, str]:
    """Fake node name of each serving or draining worker."""
    return {name: fake.name_of(info.node_id) for name, info in coordinator.workers.items()
            if coordinator.is_alive(name)}


async def serve(coordinator, prompts: list[list[int]], max_tokens: int, tag: str):
    runs = [collect(coordinator, request(f"{tag}{i}", p, greedy(max_tokens))) for i, p in enumerate(prompts)]
    return await asyncio.wait_for(asyncio.gather(*runs), LOAD_TIMEOUT_S)


def test_an_added_decode_worker_lands_on_the_node_holding_no_worker_and_serves(fake, coordinator, checkpoint,
                                                                                 vocab, hf_greedy):
    start = nodes_of(fake, coordinator)
    assert start["prefill-0"] == "a" and start["decode-0"] in ("b", "c")
    prompts = random_prompts([19, 37, 52, 70, 26], vocab, seed=31)

    async def run():
        first = await serve(coordinator, prompts[:1], 8, "before")
        answer = await coordinator.scaling.scale("decode", 1)
        both = await serve(coordinator, prompts[1:], 8, "after")
        await wait_until_idle(coordinator)
        return answer, first + both

    answer, results = asyncio.run(run())
    assert answer["started"] == ["decode-1"] and answer["workers"]["decode-1"]["state"] == "serving"
    where = nodes_of(fake, coordinator)
    assert where["decode-1"] == ({"b", "c"} - {start["decode-0"]}).pop()
    assert {info.node_id for info in coordinator.workers.values()} == set(fake.node_ids().values())
    assert [tokens for tokens, _ in results] == hf_greedy(checkpoint, prompts, 8)
    assert {last.timing.decode_worker for _, last in results[1:]} == {"decode-0", "decode-1"}
    assert all(last.timing.kv_bytes > 0 and last.timing.migrations == 0 for _, last in results)


def test_a_worker_past_the_nodes_is_refused_and_nothing_changes(coordinator):
    """Every node holds a worker: one more of either role is refused before anything starts, naming the rule;
    the worker set, the placement groups and the actors stay as they were."""
    scaling = coordinator.scaling
    before, groups, actors = scaling.describe(), group_ids(), dict(coordinator.workers)

    async def run():
        for role in ("decode", "prefill"):
            with pytest.raises(ScaleRefused, match=f"STRICT_SPREAD puts every worker on a node of its own: 1 more "
                                                   rf"{role} worker\(s\) need 1 node\(s\) that hold none of this "
                                                   r"cluster's 3 workers .* has 0 \(of 4 alive; 3 hold its workers\)"):
                await scaling.scale(role, 1)

    asyncio.run(run())
    assert scaling.describe() == before and coordinator.workers == actors and group_ids() == groups


def test_a_node_with_room_for_two_workers_takes_one(fake, coordinator):
    """A fourth node, d, with 2 CPUs in the decode pool: an added decode worker goes there; a second one is
    refused although d has a CPU free, and with a maximum given (so that a Ray autoscaler could add a node)
    its group, pinned away from the nodes holding workers, waits the start timeout and is removed with
    nothing changed. The worker on d is drained and d removed: three nodes again."""
    scaling, config = coordinator.scaling, coordinator.scaling._config
    node_d = fake.cluster.add_node(num_cpus=2, resources={DECODE_POOL: 4}, node_ip_address=NODE_IP)
    fake.cluster.wait_for_nodes()

    async def run():
        (added,) = (await scaling.scale("decode", 1))["started"]
        assert coordinator.workers[added].node_id == node_d.node_id
        before, groups = scaling.describe(), group_ids()
        with pytest.raises(ScaleRefused, match="STRICT_SPREAD puts every worker on a node of its own"):
            await scaling.scale("decode", 1)
        scaling._config = dataclasses.replace(config, bounds=WorkerBounds(max_decode=4), worker_start_timeout_s=2.0)
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match="nothing changed: Ray could not place 1 workers .* within 2s"
                                                     ".* STRICT_SPREAD: on a node that holds none"):
            await scaling.scale("decode", 1)
        assert time.monotonic() - started < 30.0
        assert scaling.describe()["workers"] == before["workers"] and group_ids() == groups
        scaling._config = config
        pid = coordinator.workers[added].pid
        assert (await scaling.scale("decode", -1))["draining"] == [added]   # idle: it stops at once
        await scaling.settled()
        return pid

    try:
        pid = asyncio.run(run())
    finally:
        scaling._config = config
        fake.cluster.remove_node(node_d)
    assert wait_gone({pid}) and len(workers_in(coordinator, "decode")) == 2


def group_ids() -> list[str]:
    return sorted(group["placement_group_id"] for group in live_placement_groups())


def test_draining_a_decode_worker_while_it_streams_fails_no_request(fake, coordinator, checkpoint, vocab,
                                                                    hf_greedy):
    """Both decode workers stream a request; one is drained: it finishes its request (no migration), then
    its process is gone and its own group removed. A decode worker added next goes to the node it left."""
    prompts = random_prompts([23, 41], vocab, seed=32)
    before = nodes_of(fake, coordinator)

    async def run():
        decoding: asyncio.Queue = asyncio.Queue()
        runs = [asyncio.ensure_future(collect(coordinator, request(f"drain{i}", p, greedy(96)), decoding))
                for i, p in enumerate(prompts)]
        for _ in prompts:
            await asyncio.wait_for(decoding.get(), LOAD_TIMEOUT_S)
        assert all(coordinator.scaling._held(name)[0] == 1 for name in ("decode-0", "decode-1"))
        running = whereabouts(coordinator)
        (name,) = (await coordinator.scaling.scale("decode", -1))["draining"]
        results = await asyncio.wait_for(asyncio.gather(*runs), LOAD_TIMEOUT_S)
        await coordinator.scaling.settled()
        await wait_until_idle(coordinator)
        gone = running[name]
        added = (await coordinator.scaling.scale("decode", 1))["started"]
        return name, gone, results, added

    name, gone, results, added = asyncio.run(run())
    assert [tokens for tokens, _ in results] == hf_greedy(checkpoint, prompts, 96)
    assert name in {last.timing.decode_worker for _, last in results}
    assert all(last.finish_reason == "length" and last.timing.migrations == 0 for _, last in results)
    released([gone])
    (new,) = added   # a new name: names are never reused (the refused start above took decode-2)
    assert new not in before and nodes_of(fake, coordinator)[new] == before[name]
    assert sorted(workers_in(coordinator, "decode")) == sorted({"decode-0", "decode-1", new} - {name})
    follow_up = random_prompts([33], vocab, seed=33)
    tokens = asyncio.run(serve(coordinator, follow_up, 6, "last"))
    assert [t for t, _ in tokens] == hf_greedy(checkpoint, follow_up, 6)
