"""The gRPC server's bounds on what comes in: its received messages are bounded like an HTTP body, dead or idle
connections are found and dropped (keepalive pings, max connection idle and age), and a channel dropped for
idleness reconnects and is served."""
from __future__ import annotations

import asyncio

import grpc

from cluster.api.grpc_server import GrpcServerConfig, start_grpc_server
from cluster.api.http_server import HttpServerConfig
from engine import LLM
from proto import tandem_pb2, tandem_pb2_grpc
from tests.support.frontend_rig import local_backend

GOAWAY_TIMEOUT_S = 10.0  # generous: the idle bound in the test is 0.3 s


def test_the_server_options_bound_messages_and_connections():
    options = dict(GrpcServerConfig().server_options())
    assert options["grpc.max_receive_message_length"] == HttpServerConfig().max_body_bytes
    assert options["grpc.max_send_message_length"] == HttpServerConfig().max_body_bytes
    assert options["grpc.keepalive_time_ms"] == 60_000 and options["grpc.keepalive_timeout_ms"] == 20_000
    assert options["grpc.max_connection_idle_ms"] == 300_000
    assert options["grpc.max_connection_age_ms"] == 3_600_000
    assert options["grpc.max_connection_age_grace_ms"] == 600_000
    small = dict(GrpcServerConfig(max_message_bytes=4096, max_connection_idle_s=0.25).server_options())
    assert small["grpc.max_receive_message_length"] == 4096 and small["grpc.max_connection_idle_ms"] == 250


def test_an_idle_connection_is_told_to_go_away_and_the_client_reconnects():
    engine = LLM("tiny", kv_cache_memory=8 << 20).engine

    async def scenario():
        async with local_backend(engine) as backend:
            server, port = await start_grpc_server(backend, GrpcServerConfig(max_connection_idle_s=0.3))
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = tandem_pb2_grpc.TandemStub(channel)
                    assert (await stub.Health(tandem_pb2.HealthRequest())).status == "SERVING"
                    assert channel.get_state() == grpc.ChannelConnectivity.READY
                    deadline = asyncio.get_running_loop().time() + GOAWAY_TIMEOUT_S
                    while channel.get_state() != grpc.ChannelConnectivity.IDLE:  # the server's GOAWAY
                        assert asyncio.get_running_loop().time() < deadline, "the idle connection was kept"
                        await asyncio.sleep(0.05)
                    request = tandem_pb2.GenerateRequest(prompt="again", max_tokens=2, ignore_eos=True)
                    tokens = [t async for response in stub.Generate(request) for t in response.token_ids]
                    assert len(tokens) == 2
            finally:
                await server.stop(None)

    asyncio.run(scenario())
