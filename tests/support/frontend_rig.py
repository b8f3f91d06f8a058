"""Shared by the front-end tests: a LocalEngineBackend over a real engine, and the end-of-test checks
that every KV block is free and no request is live."""
from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from cluster.api.admission import AdmissionBound
from cluster.api.grpc_server import GrpcServerConfig, start_grpc_server
from cluster.local.backend import LocalBackendConfig, LocalEngineBackend
from engine import SamplingParams
from proto import tandem_pb2_grpc

IDLE_TIMEOUT_S = 10.0


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def assert_pool_free(engine) -> None:
    assert engine.num_live_requests == 0
    assert engine.num_free_blocks == engine.num_total_blocks


async def wait_until_idle(engine, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Waits for the engine thread to finish or abort everything, then checks the pool is free."""
    deadline = time.monotonic() + timeout_s
    while (engine.num_live_requests or engine.num_free_blocks != engine.num_total_blocks) \
            and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert_pool_free(engine)


async def wait_until_busy(engine, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Waits until the engine holds a live request (admitted by its thread)."""
    deadline = time.monotonic() + timeout_s
    while engine.num_live_requests == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert engine.num_live_requests > 0


@contextlib.asynccontextmanager
async def local_backend(engine, max_pending_requests: int | None = None, **config_fields):
    """A LocalEngineBackend owning `engine` for the block (behind the AdmissionBound `tandem serve` puts
    in front of every backend, when max_pending_requests is given); on a clean exit the pool must be free
    before the backend shuts down (so shutdown never hides a leak), and after."""
    backend = LocalEngineBackend(engine, LocalBackendConfig(**config_fields))
    if max_pending_requests is not None:
        backend = AdmissionBound(backend, max_pending_requests)
    try:
        yield backend
        await wait_until_idle(engine)
    finally:
        await backend.shutdown()
    assert_pool_free(engine)


def fail_next_step(engine, monkeypatch, message: str) -> None:
    """The engine's next step raises RuntimeError(message) (a device fault, say); later steps run."""
    real_step, failures = engine.step, []

    def step_that_fails_once():
        if not failures:
            failures.append(True)
            raise RuntimeError(message)
        return real_step()

    monkeypatch.setattr(engine, "step", step_that_fails_once)


@contextlib.asynccontextmanager
async def grpc_stub(engine, *, api_key=None, max_message_bytes=1 << 20, **backend_fields):
    """A TandemStub on a gRPC front end over a local backend of `engine`; waits for the engine to go idle at the end."""
    async with local_backend(engine, **backend_fields) as backend:
        config = GrpcServerConfig(api_key=api_key, max_message_bytes=max_message_bytes)
        server, port = await start_grpc_server(backend, config)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            yield tandem_pb2_grpc.TandemStub(channel)
            await wait_until_idle(engine)
        finally:
            await channel.close()
            await server.stop(None)
