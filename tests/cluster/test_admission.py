"""--max-pending-requests bounds the requests in the system in every mode (cluster/api/admission.py):
one count for both front ends, 429 / RESOURCE_EXHAUSTED past it, room again once a request ends.
Colocated in process here; disaggregated through `tandem serve` in test_serve_operators.py."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import grpc
import pytest

from cluster.api.admission import AdmissionBound
from cluster.api.grpc_server import GrpcServerConfig, start_grpc_server
from cluster.api.http_server import HttpServerConfig, start_http_server
from cluster.api.metrics import ServingMetrics
from cluster.backend import BackendOverloaded, GenerationRequest
from engine import LLM
from proto import tandem_pb2, tandem_pb2_grpc
from tests.support.frontend_rig import greedy, local_backend, wait_until_busy, wait_until_idle
from tests.support.http_rig import KV_BYTES, completion_body


@pytest.fixture(scope="module")
def served():
    return LLM("tiny", kv_cache_memory=KV_BYTES).engine


def test_one_bound_counts_the_requests_of_both_front_ends(served):
    async def scenario():
        async with local_backend(served, model_name="tiny-llama") as engine_backend:
            bound = AdmissionBound(engine_backend, max_pending_requests=1)
            metrics = ServingMetrics()
            server, grpc_port = await start_grpc_server(bound, GrpcServerConfig(), metrics)
            runner, http_port = await start_http_server(bound, HttpServerConfig(), metrics)
            try:
                async with aiohttp.ClientSession(f"http://127.0.0.1:{http_port}") as session, \
                        grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                    stub = tandem_pb2_grpc.TandemStub(channel)
                    return await _hold_over_http_refuse_over_grpc(session, stub, bound, served)
            finally:
                await server.stop(None)
                await runner.cleanup()

    refused, in_flight_gauge, after = asyncio.run(scenario())
    assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tandem_requests_in_flight 1.0" in in_flight_gauge and "tandem_max_pending_requests 1.0" in in_flight_gauge
    assert after == 2


async def _hold_over_http_refuse_over_grpc(session, stub, bound: AdmissionBound, engine) -> tuple:
    holder = await session.post("/v1/completions", json=completion_body("Hold", engine.max_model_len - 50, stream=True))
    assert (await holder.content.readline()).startswith(b"data: ")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Generate(tandem_pb2.GenerateRequest(prompt="one too many", max_tokens=2)):
            pass
    async with session.get("/metrics") as response:
        gauges = await response.text()
    holder.close()
    await wait_until_idle(engine)
    assert bound.in_flight == 0
    after = [r async for r in stub.Generate(tandem_pb2.GenerateRequest(prompt="room", max_tokens=2, ignore_eos=True))]
    return caught.value.code(), gauges, sum(len(r.token_ids) for r in after)


def test_the_bound_refuses_before_the_backend_sees_the_request_and_frees_its_place(served):
    async def scenario():
        async with local_backend(served, max_pending_requests=2) as bound:
            first, second = bound.generate(_request("a")), bound.generate(_request("b"))
            await anext(first), await anext(second)
            await wait_until_busy(served)
            with pytest.raises(BackendOverloaded, match="the limit is 2"):
                await anext(bound.generate(_request("c")))
            health = await bound.health()
            await first.aclose()
            refill = bound.generate(_request("d"))
            await anext(refill)
            await second.aclose(), await refill.aclose()
            return health.details, bound.in_flight

    details, in_flight = asyncio.run(scenario())
    assert (details["requests_in_flight"], details["max_pending_requests"]) == (2, 2)
    assert in_flight == 0
    with pytest.raises(ValueError, match="max_pending_requests"):
        AdmissionBound(object(), 0)


def _request(request_id: str) -> GenerationRequest:
    return GenerationRequest(request_id, (1, 2, 3), greedy(1000), time.perf_counter())
