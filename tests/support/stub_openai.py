"""A stub OpenAI-compatible server on loopback, in a thread: GET /v1/models and streamed POST /v1/completions
(one token id per SSE chunk, `max_tokens` of them), or HTTP 500 for every completion when told to fail.

    with StubOpenAIServer() as server:          # server.base_url: http://127.0.0.1:<free port>
        ...
"""
from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web


class StubOpenAIServer:
    def __init__(self, fail_completions: bool = False) -> None:
        self.fail_completions = fail_completions
        self.base_url = ""
        self.completions = 0  # requests answered (or refused), counted in the server's thread
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="stub-openai")
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> "StubOpenAIServer":
        self._thread.start()
        self.base_url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def __exit__(self, *exc_info) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub", "max_model_len": 4096}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.completions += 1
        if self.fail_completions:
            return web.json_response({"error": {"message": "stub told to fail"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(int(body["max_tokens"])):
            chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [index % 7]}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.002)
        await response.write(b"data: [DONE]\n\n")
        return response
