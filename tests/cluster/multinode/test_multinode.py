"""Placement across Ray nodes, on one machine: a head and three worker nodes of ray.cluster_utils.Cluster
(tests/support/fake_nodes.py; one for this package: conftest.py), all on 127.0.0.2, each with 1 CPU, one
logical GPU and a node pool's custom resources. Engines run on CPU (device="cpu"); the fake GPUs exercise the
GPU placement logic only.

STRICT_SPREAD puts prefill and decode workers on different nodes (WorkerInfo, /health, /metrics say which)
and KV crosses nodes over grpc and over gloo with greedy output equal to a local engine's; role pools by
custom resources; `tandem serve --address --node-ip-address` joins the cluster; removing the node of a
decode worker mid-load migrates its requests; a placement the cluster cannot satisfy fails before anything
starts. Every test ends with every pool empty and no actor, placement group or worker process left.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.api.metrics import ServingMetrics
from cluster.coordinator.start import start_cluster
from cluster.workers.cluster_config import ClusterConfig
from cluster.workers.launch import resolve_device
from cluster.workers.placement import place_bundles, start_actor
from cluster.workers.placement_check import worker_bundles
from engine import LLM
from tests.support.cluster_rig import SMALL_ENGINE, cluster_config, collect, greedy, request, wait_until_idle
from tests.support.engine_checks import random_prompts
from tests.support.fake_nodes import (DECODE_POOL, NODE_IP, PREFILL_POOL, VISIBLE_GPUS, alive_actors, assert_released,
                                      live_placement_groups)
from tests.support.serve_process import TANDEM, start_serve

VOCAB = 256
JOB = Path(__file__).resolve().parents[3] / "deploy" / "job.py"
AGENT_WAIT_S = 60.0  # how long a submission refused for want of a job agent is tried again
LOAD_TIMEOUT_S = 120.0   # a bound on every wait for requests: nothing may hang


@pytest.fixture(scope="module")
def local() -> LLM:
    return LLM("tiny", kv_cache_memory=SMALL_ENGINE.kv_cache_memory)


def spread(num_prefill: int, num_decode: int, transport: str, **fields) -> ClusterConfig:
    fields.setdefault("placement_strategy", "STRICT_SPREAD")
    return dataclasses.replace(cluster_config(num_prefill, num_decode, transport), **fields)


def expected_tokens(local: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outputs = local.generate(prompt_token_ids=prompts, sampling_params=greedy(max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


async def generate_all(coordinator, prompts: list[list[int]], max_tokens: int, tag: str):
    runs = [collect(coordinator, request(f"{tag}{i}", p, greedy(max_tokens))) for i, p in enumerate(prompts)]
    return await asyncio.wait_for(asyncio.gather(*runs), LOAD_TIMEOUT_S)


def stop(coordinator) -> None:
    """Pools empty, then shutdown; nothing of the workers is left in the cluster."""
    asyncio.run(wait_until_idle(coordinator))
    pids = {info.pid for info in coordinator.workers.values()}
    asyncio.run(coordinator.shutdown())
    assert_released(pids)


def test_strict_spread_puts_every_worker_on_a_node_of_its_own_and_grpc_kv_crosses_them(fake, local):
    """1 prefill + 2 decode workers, STRICT_SPREAD: three different nodes, reported by WorkerInfo and in
    the /health details and /metrics labels; decode workers receive KV on their node's address; greedy
    output over grpc equals the local engine's."""
    coordinator = start_cluster(spread(1, 2, "grpc"))
    try:
        infos = coordinator.workers
        assert len({info.node_id for info in infos.values()}) == 3
        assert {info.node_id for info in infos.values()} == set(fake.node_ids().values())
        assert all(info.node_ip == NODE_IP and info.device == "cpu" for info in infos.values())
        assert all(infos[name].kv_address.target.startswith(f"{NODE_IP}:") for name in ("decode-0", "decode-1"))
        prompts = random_prompts([20, 33, 47, 64], VOCAB, seed=3)
        results = asyncio.run(generate_all(coordinator, prompts, 12, "g"))
        assert [tokens for tokens, _ in results] == expected_tokens(local, prompts, 12)
        assert all(last.timing.kv_bytes > 0 and last.timing.migrations == 0 for _, last in results)
        health = asyncio.run(coordinator.health())
        entries = health.details["workers"]
        assert {name: entry["node_id"] for name, entry in entries.items()} == \
            {name: info.node_id for name, info in infos.items()}
        samples = [s for family in text_string_to_metric_families(ServingMetrics().render(health).decode())
                   for s in family.samples if s.name == "tandem_worker_info"]
        assert {s.labels["worker"]: (s.labels["role"], s.labels["node_id"], s.labels["node_ip"]) for s in samples} \
            == {name: (info.role, info.node_id, NODE_IP) for name, info in infos.items()}
    finally:
        stop(coordinator)


def test_gloo_kv_crosses_nodes_and_each_role_runs_in_its_node_pool(fake, local):
    """prefill_resources / decode_resources pin the prefill worker to node a (the prefill pool) and the
    decode worker to b or c (PACK would otherwise put them wherever); KV over gloo between those nodes,
    the decode worker's control listener on its node's address; greedy output equals the local engine's."""
    config = spread(1, 1, "gloo", placement_strategy="PACK", prefill_resources={PREFILL_POOL: 1},
                    decode_resources={DECODE_POOL: 1})
    coordinator = start_cluster(config)
    try:
        where = {name: fake.name_of(info.node_id) for name, info in coordinator.workers.items()}
        assert where["prefill-0"] == "a" and where["decode-0"] in ("b", "c")
        prompts = random_prompts([18, 40, 71], VOCAB, seed=5)
        results = asyncio.run(generate_all(coordinator, prompts, 10, "gl"))
        assert [tokens for tokens, _ in results] == expected_tokens(local, prompts, 10)
        assert all(last.timing.kv_bytes > 0 and last.timing.transfer_ms > 0 for _, last in results)
    finally:
        stop(coordinator)


def test_removing_the_node_of_a_decode_worker_mid_load_migrates_its_requests(fake, local):
    """Cluster.remove_node of the node holding decode-1 while four requests decode: its raylet and its
    worker die with it; the requests on it continue on decode-0 (same greedy tokens); none fails, none
    hangs (bounded wait); decode-1 is reported dead. The node is added back for the tests after this one."""
    coordinator = start_cluster(spread(1, 2, "grpc"))
    victim = coordinator.workers["decode-1"]
    victim_node = fake.name_of(victim.node_id)
    prompts = random_prompts([21, 22, 23, 24], VOCAB, seed=9)

    async def run():
        decoding: asyncio.Queue = asyncio.Queue()
        runs = [asyncio.ensure_future(collect(coordinator, request(f"m{i}", p, greedy(200)), decoding))
                for i, p in enumerate(prompts)]
        for _ in prompts:
            await asyncio.wait_for(decoding.get(), LOAD_TIMEOUT_S)
        await asyncio.to_thread(fake.remove, victim_node)
        return await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), LOAD_TIMEOUT_S)

    try:
        results = asyncio.run(run())
        assert not [r for r in results if isinstance(r, BaseException)], results
        assert [tokens for tokens, _ in results] == expected_tokens(local, prompts, 200)
        assert [last.timing.decode_worker for _, last in results] == ["decode-0"] * 4
        assert sum(last.timing.migrations for _, last in results) >= 1
        health = asyncio.run(coordinator.health())
        assert health.serving and health.details["dead_workers"] == ["decode-1"]
    finally:
        stop(coordinator)
        if victim_node not in fake.nodes:
            fake.add(victim_node)
            fake.cluster.wait_for_nodes()


def test_serve_joins_the_cluster_with_node_ip_address_and_serves_over_http(fake):
    """`tandem serve --address 127.0.0.2:PORT --node-ip-address 127.0.0.2` in a subprocess joins the cluster
    as a driver (without the flag Ray would look for a node on the host's routable address), places
    STRICT_SPREAD workers with the prefill pool from --prefill-resources, serves a completion over HTTP;
    /health and /metrics name each worker's node; on SIGTERM it releases its actors and placement group
    (the cluster stays up)."""
    with start_serve("--address", fake.address, "--node-ip-address", NODE_IP, "--prefill-workers", "1",
                     "--decode-workers", "1", "--placement-strategy", "STRICT_SPREAD", "--transport", "grpc",
                     "--device", "cpu", "--kv-cache-memory-mib", "16",
                     "--prefill-resources", json.dumps({PREFILL_POOL: 1})) as (proc, _, http_port):
        reply = http_json(http_port, "/v1/completions", {"prompt": [104, 105], "max_tokens": 6, "temperature": 0,
                                                         "ignore_eos": True, "return_token_ids": True})
        assert len(reply["choices"][0]["token_ids"]) == 6 and reply["tandem_timing"]["kv_bytes"] > 0
        workers = http_json(http_port, "/health")["workers"]
        assert fake.name_of(workers["prefill-0"]["node_id"]) == "a"
        assert workers["decode-0"]["node_id"] != workers["prefill-0"]["node_id"]
        assert all(w["node_ip"] == NODE_IP for w in workers.values())
        metrics = wait_for_empty_pools(http_port)
        assert all(f'node_id="{w["node_id"]}"' in metrics for w in workers.values())
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    assert_released({w["pid"] for w in workers.values()})


def http_json(port: int, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    call = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                  headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(call, timeout=LOAD_TIMEOUT_S).read())


def wait_for_empty_pools(http_port: int, timeout_s: float = 15.0) -> str:
    """/metrics once every worker's free KV blocks equal its total (fails at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30).read().decode()
        values = {(s.name, s.labels["worker"]): s.value for f in text_string_to_metric_families(text)
                  for s in f.samples if s.name in ("tandem_worker_kv_free_blocks", "tandem_worker_kv_total_blocks")}
        free = {w: v for (n, w), v in values.items() if n == "tandem_worker_kv_free_blocks"}
        if free and all(v == values[("tandem_worker_kv_total_blocks", w)] for w, v in free.items()):
            return text
        assert time.monotonic() < deadline, f"KV pools not empty: {values}"
        time.sleep(0.1)


def test_a_placement_the_cluster_cannot_satisfy_fails_before_anything_starts(fake):
    """STRICT_SPREAD with more workers than nodes that can hold one, more GPUs than exist, STRICT_PACK past
    the largest node, a custom resource no node has: an error naming what is missing, within seconds, with
    no actor or placement group started. One that could fit but whose resources are held elsewhere waits
    at most worker_start_timeout_s, then says what is free."""
    cases = [(spread(2, 2, "grpc"), "STRICT_SPREAD puts every worker on a node of its own: 4 workers need 4 "
                                    "nodes that can each hold one, the Ray cluster has 3"),
             (spread(2, 2, "auto", device="cuda"), "device cuda needs 4 GPUs in the Ray cluster"),
             (spread(1, 1, "auto", device="cuda", placement_strategy="STRICT_PACK"),
              r"STRICT_PACK puts all 2 workers on one node: they need \{CPU: 2, GPU: 2\}"),
             (spread(1, 1, "grpc", decode_resources={"tandem_nowhere": 1}),
              "no node of the Ray cluster can hold a decode worker.*tandem_nowhere: needs 1, no node has it")]
    for config, message in cases:
        started = time.monotonic()
        with pytest.raises(ValueError, match=message):
            start_cluster(config)
        assert time.monotonic() - started < 5.0
        assert not alive_actors() and not live_placement_groups()
    held = place_bundles([("other", {PREFILL_POOL: 4})], "PACK", timeout_s=30)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=f"within 2s: with the resources free now.*{PREFILL_POOL}"):
            start_cluster(spread(1, 1, "grpc", prefill_resources={PREFILL_POOL: 1}, worker_start_timeout_s=2.0))
        assert time.monotonic() - started < 10.0
    finally:
        ray.util.remove_placement_group(held)
    assert_released(set())


def test_serve_refuses_an_unsatisfiable_strategy_with_the_reason(fake):
    done = subprocess.run([*TANDEM, "serve", "--address", fake.address, "--node-ip-address", NODE_IP,
                           "--prefill-workers", "2", "--decode-workers", "2", "--device", "cpu",
                           "--placement-strategy", "STRICT_SPREAD", "--grpc-port", "0", "--http-port", "0",
                           "--model", "tiny"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "tandem: error: STRICT_SPREAD puts every worker on a node of its own" in done.stderr
    assert_released(set())


@ray.remote
class _GpuProbe:
    def where(self) -> tuple[str, list[str]]:
        ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        return ray.get_runtime_context().get_node_id(), [str(i) for i in ids]


def test_gpu_bundles_on_fake_gpu_nodes(fake):
    """The GPU logic on logical GPUs: auto picks cuda when every worker can have a GPU (3 here), cpu when
    not; STRICT_SPREAD GPU bundles land one per node, each actor given its node's own GPU id (the node's
    CUDA_VISIBLE_DEVICES)."""
    assert resolve_device(ClusterConfig(num_prefill_workers=1, num_decode_workers=2)) == "cuda"
    assert resolve_device(ClusterConfig(num_prefill_workers=2, num_decode_workers=2)) == "cpu"
    group = place_bundles(worker_bundles([("prefill", 1, {}), ("decode", 2, {})], 1, 1.0), "STRICT_SPREAD", 30)
    try:
        probes = [start_actor(_GpuProbe, group, index, 1.0, 1) for index in range(3)]
        found = ray.get([probe.where.remote() for probe in probes], timeout=60)
        assert sorted(fake.name_of(node) for node, _ in found) == ["a", "b", "c"]
        assert all(ids == [VISIBLE_GPUS[fake.name_of(node)]] for node, ids in found)
        for probe in probes:
            ray.kill(probe)
    finally:
        ray.util.remove_placement_group(group)
    assert_released(set())


def test_ray_job_submit_of_deploy_job_runs_on_the_cluster(fake):
    """`ray job submit` of deploy/job.py to the head's job server: the job's driver runs on the head (no
    CPU), its two workers on the worker nodes (1 CPU each: two nodes), requests go over gRPC, the job checks
    its pools are empty and exits 0. The code comes from the installed package (as deploy/cluster.yaml
    installs it on every node), not --working-dir: on one machine every fake node re-extracts the uploaded
    working dir into the same place under the running driver (deploy/README.md)."""
    if fake.dashboard_url is None:
        pytest.skip("ray job submit needs the Ray dashboard: pip install 'ray[default]' (the jobs extra)")
    command = [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", fake.dashboard_url, "--",
               sys.executable, str(JOB), "--requests", "2", "--max-tokens", "4", "--device", "cpu", "--kv-cache-mib",
               "16", "--model", "tiny"]
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:  # the head's job agent registers a while after its dashboard answers: Ray says to try again later
        done = subprocess.run(command, capture_output=True, text=True, timeout=240)
        if "No available agent to submit job" not in done.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "2/2 ok" in done.stdout and "KV pools empty" in done.stdout, done.stdout[-4000:]
    assert_released(set())
