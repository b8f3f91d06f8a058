"""The standard gRPC services beside tandem.v1.Tandem, through their generated stubs (what grpcurl and
health probes use): server reflection lists and describes every service without a proto file, and
grpc.health.v1.Health follows the backend over time: SERVING (degraded too), NOT_SERVING when it is
unavailable, its health check fails, or it shut down."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.api.grpc_server import GrpcServerConfig, start_grpc_server
from engine import LLM
from tests.support.frontend_rig import local_backend, wait_until_idle

KV_BYTES = 8 << 20
API_KEY = "s3cret-key"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = {"tandem.v1.Tandem", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


@pytest.fixture(scope="module")
def served():
    return LLM("tiny", kv_cache_memory=KV_BYTES).engine


class ScriptedHealth:
    """The real backend, with the health the test sets (`serving`, lost workers, or a failing check)."""

    def __init__(self, backend) -> None:
        self._backend = backend
        self.model_name, self.max_model_len = backend.model_name, backend.max_model_len
        self.serving, self.lost, self.fails = True, {}, False

    @property
    def tokenizer(self):
        return self._backend.tokenizer

    def generate(self, request):
        return self._backend.generate(request)

    async def health(self):
        if self.fails:
            raise RuntimeError("the health check itself failed")
        health = await self._backend.health()
        details = {**health.details, "worker_failures": dict(self.lost)}
        return dataclasses.replace(health, serving=self.serving, details=details)

    async def shutdown(self):
        await self._backend.shutdown()


@contextlib.asynccontextmanager
async def grpc_channel(backend, **config_fields):
    server, port = await start_grpc_server(backend, GrpcServerConfig(health_poll_s=0.05, **config_fields))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


async def next_status(watch, expected: int, timeout_s: float = 5.0) -> None:
    """Reads the Watch stream until it says `expected`."""
    async def read():
        while (await watch.read()).status != expected:
            pass
    await asyncio.wait_for(read(), timeout_s)


def test_reflection_lists_and_describes_every_service_without_a_proto_file(served):
    async def scenario():
        async with local_backend(served) as backend, grpc_channel(backend, api_key=API_KEY) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                        reflection_pb2.ServerReflectionRequest(file_containing_symbol="tandem.v1.Tandem")]
            return [answer async for answer in stub.ServerReflectionInfo(iter(requests))]  # no API key needed

    listed, described = asyncio.run(scenario())
    assert {service.name for service in listed.list_services_response.service} == SERVICES
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in described.file_descriptor_response.file_descriptor_proto]
    tandem = next(f for f in files if f.package == "tandem.v1")
    methods = {m.name: (m.input_type, m.server_streaming) for s in tandem.service if s.name == "Tandem"
               for m in s.method}
    assert methods["Generate"] == (".tandem.v1.GenerateRequest", True)


def test_health_is_serving_then_not_serving_once_the_backend_shuts_down(served):
    async def scenario():
        async with local_backend(served) as backend, grpc_channel(backend, api_key=API_KEY) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            before = [(await stub.Check(health_pb2.HealthCheckRequest(service=name))).status
                      for name in ("", "tandem.v1.Tandem")]
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            await next_status(watch, SERVING)
            await wait_until_idle(served)
            await backend.shutdown()
            await next_status(watch, NOT_SERVING)
            after = (await stub.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Tandem"))).status
            watch.cancel()
        return before, unknown.value.code(), after

    before, unknown, after = asyncio.run(scenario())
    assert before == [SERVING, SERVING] and after == NOT_SERVING
    assert unknown == grpc.StatusCode.NOT_FOUND


def test_health_follows_degraded_unavailable_and_failing_backends(served):
    async def scenario():
        async with local_backend(served) as backend:
            scripted = ScriptedHealth(backend)
            async with grpc_channel(scripted) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
                await next_status(watch, SERVING)
                scripted.lost = {"decode-1": "it did not answer a health check within 30s"}  # degraded: serves
                await asyncio.sleep(0.3)
                degraded = (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())).status
                scripted.serving = False  # no decode worker left
                await next_status(watch, NOT_SERVING)
                scripted.serving = True
                await next_status(watch, SERVING)
                scripted.fails = True
                await next_status(watch, NOT_SERVING)
                watch.cancel()
        return degraded

    assert asyncio.run(scenario()) == SERVING


def test_the_health_poll_interval_is_checked():
    for poll_s in (0, -1, 61):
        with pytest.raises(ValueError, match="health_poll_s"):
            GrpcServerConfig(health_poll_s=poll_s)
