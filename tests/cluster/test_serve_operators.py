"""`tandem serve` in disaggregated mode as users run it (a real process, a local Ray, 1 prefill + 1 decode
worker), through the clients users have: the openai SDK sees 429 past --max-pending-requests and the
served names, the standard gRPC health stub sees SERVING, then NOT_SERVING as soon as the server stops;
GET /admin/workers lists the workers within the bounds the flags gave (the autoscaler running)."""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import time
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from cluster.serve import add_arguments, cluster_config, config_from_args
from tests.support.serve_process import start_serve

NAMES = ("tandem-a", "tandem-b")
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_disaggregated_serve_bounds_admission_and_reports_health_until_it_stops():
    with start_serve("--prefill-workers", "1", "--decode-workers", "1", "--max-pending-requests", "1",
                     "--served-model-name", *NAMES, "--kv-cache-memory-mib", "16",
                     "--shutdown-grace-s", "20", "--max-decode-workers", "2", "--max-prefill-workers", "1",
                     "--autoscale") as (proc, grpc_port, http_port):
        outcomes, health_before, health_stopping = asyncio.run(scenario(proc, grpc_port, http_port))
        assert proc.wait(timeout=60) == 0
    assert sorted(set(outcomes)) == [200, 429] and outcomes.count(200) >= 1, outcomes
    assert health_before == [SERVING, SERVING] and health_stopping == NOT_SERVING


async def scenario(proc: subprocess.Popen, grpc_port: int, http_port: int) -> tuple:
    base_url = f"http://127.0.0.1:{http_port}"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel, \
            openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client:
        health = health_pb2_grpc.HealthStub(channel)
        listing = await asyncio.to_thread(lambda: urllib.request.urlopen(f"{base_url}/admin/workers").read())
        workers = json.loads(listing)
        assert workers["workers"] == {"prefill-0": {"role": "prefill", "state": "serving"},
                                      "decode-0": {"role": "decode", "state": "serving"}}
        assert workers["bounds"] == {"prefill": {"min": 1, "max": 1}, "decode": {"min": 1, "max": 2}}
        assert workers["autoscale_decisions"] == []
        before = [(await health.Check(health_pb2.HealthCheckRequest(service=name))).status
                  for name in ("", "tandem.v1.Tandem")]
        outcomes = await asyncio.gather(*(complete(client, NAMES[1]) for _ in range(4)))
        assert await complete(client, NAMES[0]) == 200  # the bound let go of every request
        await asyncio.to_thread(wait_until_pools_whole, base_url)
        stream = await client.completions.create(model=NAMES[0], prompt="hold on", max_tokens=2000, stream=True,
                                                 extra_body={"ignore_eos": True})
        await anext(aiter(stream))
        proc.send_signal(signal.SIGTERM)  # drains for up to 20 s: the stream holds it open meanwhile
        stopping = await wait_for_status(health, NOT_SERVING)
        await stream.close()  # the client leaves; the drain ends and the server exits
    return outcomes, before, stopping


async def complete(client: openai.AsyncOpenAI, model: str) -> int:
    """200, or 429 when the server refused the request as overloaded."""
    try:
        answer = await client.completions.create(model=model, prompt="Tandem", max_tokens=32, temperature=0,
                                                 extra_body={"ignore_eos": True})
    except openai.RateLimitError as error:
        assert error.code == "overloaded", error
        return 429
    assert answer.model == model and answer.usage.completion_tokens == 32
    return 200


async def wait_for_status(health, expected: int, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        status = (await health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Tandem"))).status
        if status == expected:
            break
        await asyncio.sleep(0.1)
    return status


def wait_until_pools_whole(base_url: str, timeout_s: float = 30.0) -> None:
    """Until /metrics shows every worker's KV pool whole and no request in flight (no block leaked)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = urllib.request.urlopen(f"{base_url}/metrics", timeout=30).read().decode()
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        free = {s.labels["worker"]: s.value for s in samples if s.name == "tandem_worker_kv_free_blocks"}
        total = {s.labels["worker"]: s.value for s in samples if s.name == "tandem_worker_kv_total_blocks"}
        in_flight = [s.value for s in samples if s.name == "tandem_requests_in_flight"]
        if len(free) == 2 and free == total and in_flight == [0.0]:
            return
        assert time.monotonic() < deadline, (free, total, in_flight)
        time.sleep(0.2)


def test_served_names_and_the_bound_are_read_from_the_flags():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    named = config_from_args(parser.parse_args(["--prefill-workers", "1", "--served-model-name", *NAMES]))
    assert named.served_model_names == NAMES and named.model_name == NAMES[0]
    assert cluster_config(named).served_name == NAMES[0]  # what /health and gRPC Health report
    assert config_from_args(parser.parse_args(["--model", "/models/llama"])).model_name == "/models/llama"
    assert config_from_args(parser.parse_args([])).model_name == "tandem-default"
    for flags in (["--served-model-name", "a", "a"], ["--served-model-name", " "], ["--max-pending-requests", "0"]):
        with pytest.raises(ValueError, match=flags[0]):
            config_from_args(parser.parse_args(flags))
