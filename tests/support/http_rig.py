"""The OpenAI HTTP front end over a LocalEngineBackend on loopback, and the client helpers its tests share."""
from __future__ import annotations

import contextlib
import json

import aiohttp
import openai

from cluster.api.http_server import HttpServerConfig, start_http_server
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
