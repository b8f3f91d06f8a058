"""The OpenAI HTTP front end over a LocalEngineBackend on loopback, and the client helpers its tests share; both
front ends (HTTP and gRPC, as `tandem serve` runs them) over an engine or a running cluster."""
from __future__ import annotations

import contextlib
import dataclasses
import json

import aiohttp
import grpc
import openai

from cluster.api.grpc_server import GrpcServerConfig, start_grpc_server
from cluster.api.http_server import HttpServerConfig, start_http_server
from cluster.api.input_pool import InputPool
from cluster.api.metrics import ServingMetrics
from cluster.coordinator.coordinator import Coordinator
from proto import tandem_pb2_grpc
from tests.support.cluster_rig import wait_until_idle as cluster_idle
from tests.support.frontend_rig import local_backend, wait_until_idle

MODEL = "tiny-llama"
KV_BYTES = 8 << 20
API_KEY = "s3cret-key"
MAX_BODY_BYTES = 64 * 1024
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there, friend"}]


@contextlib.asynccontextmanager
async def http_server(engine, *, api_key=None, served_model_names=(), max_body_bytes=MAX_BODY_BYTES,
                      **backend_fields):
    """The HTTP front end over a LocalEngineBackend of `engine` on loopback; yields its base URL. At the end
    every block of the engine must be free."""
    async with local_backend(engine, model_name=MODEL, **backend_fields) as backend:
        config = HttpServerConfig(api_key=api_key, max_body_bytes=max_body_bytes,
                                  served_model_names=served_model_names)
        runner, port = await start_http_server(backend, config)
        try:
            yield f"http://127.0.0.1:{port}"
            await wait_until_idle(engine)
        finally:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def http_client(engine, **server_fields):
    """An aiohttp session on the front end of http_server(engine, **server_fields)."""
    async with http_server(engine, **server_fields) as url, aiohttp.ClientSession(url) as session:
        yield session


async def post(session, path: str, body, headers=None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(path, data=data, headers=headers) as response:
        return response.status, await response.json()


async def stream_events(session, path: str, body) -> list:
    """The SSE `data:` payloads of a streamed response, JSON-decoded except the final [DONE]."""
    async with session.post(path, json=body) as response:
        assert response.status == 200 and response.content_type == "text/event-stream"
        events = [line.decode().strip() async for line in response.content]
    payloads = [e[len("data: "):] for e in events if e]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def completion_body(prompt, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def openai_client(base_url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    """The official SDK's async client on a front end of http_server (no retries: every answer counts)."""
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0)


@contextlib.asynccontextmanager
async def backend_of(served):
    """A LocalEngineBackend over `served` when it is an engine, the Coordinator `served` itself otherwise; at the
    end every KV block must be free."""
    if isinstance(served, Coordinator):
        yield served
        await cluster_idle(served)
        return
    async with local_backend(served, model_name=MODEL) as backend:
        yield backend
        await wait_until_idle(served)


@dataclasses.dataclass(frozen=True)
class FrontEnds:
    """A client's view of the HTTP and gRPC front ends front_ends() started."""

    session: aiohttp.ClientSession  # rooted at base_url
    channel: grpc.aio.Channel       # to grpc_target
    stub: tandem_pb2_grpc.TandemStub
    base_url: str
    grpc_target: str


@contextlib.asynccontextmanager
async def front_ends(served, pool: InputPool):
    """HTTP and gRPC front ends over backend_of(served) on free loopback ports, sharing `pool` (as `tandem serve`
    does); yields FrontEnds. At the end every KV block must be free and no large input pending."""
    async with backend_of(served) as backend:
        metrics = ServingMetrics()
        server, grpc_port = await start_grpc_server(backend, GrpcServerConfig(health_poll_s=0.1), metrics, pool)
        runner, http_port = await start_http_server(backend, HttpServerConfig(served_model_names=(MODEL,)), metrics,
                                                    input_pool=pool)
        base_url, grpc_target = f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
        try:
            async with aiohttp.ClientSession(base_url) as session, grpc.aio.insecure_channel(grpc_target) as channel:
                yield FrontEnds(session, channel, tandem_pb2_grpc.TandemStub(channel), base_url, grpc_target)
            assert pool.pending == 0
        finally:
            await runner.cleanup()
            await server.stop(None)
            pool.close()
