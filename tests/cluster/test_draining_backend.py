"""DrainingBackend, the stop sequence of `tandem serve` on one asyncio loop, over a scripted backend: chunks
and errors pass unchanged; after begin_stop() new requests are refused and /health says unavailable;
drain() lets requests in flight finish; end_in_flight() ends the rest with "the server is stopping" after
the chunks they already had and closes their backend streams (aborting them); a consumer that leaves
early closes its backend stream too."""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import pytest

from cluster.api.draining_backend import STOPPING, DrainingBackend
from cluster.backend import BackendHealth, BackendUnavailable, GenerationChunk, GenerationRequest
from engine import SamplingParams


class ScriptedBackend:
    """Each request yields one chunk, then waits for `release` before its last one. Records which
    requests finished and which were closed before that (aborted)."""

    model_name, max_model_len, tokenizer = "scripted", 64, None

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.shut_down = False

    async def generate(self, request: GenerationRequest):
        if request.request_id == "invalid":
            raise ValueError("bad input")
        try:
            yield GenerationChunk((1,), "a")
            await self.release.wait()
            yield GenerationChunk((2,), "b", "length")
            self.finished.append(request.request_id)
        finally:
            if request.request_id not in self.finished:
                self.aborted.append(request.request_id)

    async def health(self) -> BackendHealth:
        return BackendHealth(True, self.model_name, 1, 1)

    async def shutdown(self) -> None:
        self.shut_down = True


def request(request_id: str) -> GenerationRequest:
    return GenerationRequest(request_id, (5, 6), SamplingParams(max_tokens=2), time.perf_counter())


async def consume(backend: DrainingBackend, request_id: str) -> tuple[list[GenerationChunk], Exception | None]:
    chunks: list[GenerationChunk] = []
    try:
        async with aclosing(backend.generate(request(request_id))) as stream:
            async for chunk in stream:
                chunks.append(chunk)
    except Exception as error:  # noqa: BLE001 - returned for the test to look at
        return chunks, error
    return chunks, None


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_chunks_and_errors_pass_and_drain_lets_requests_finish():
    async def scenario():
        inner = ScriptedBackend()
        backend = DrainingBackend(inner)
        assert (await consume(backend, "invalid"))[1].args == ("bad input",)
        running = asyncio.ensure_future(consume(backend, "r1"))
        await until(lambda: backend.in_flight == 1)
        backend.begin_stop()
        refused = await consume(backend, "late")
        assert isinstance(refused[1], BackendUnavailable) and str(refused[1]) == STOPPING
        assert not (await backend.health()).serving and (await inner.health()).serving
        asyncio.get_running_loop().call_later(0.2, inner.release.set)
        assert await backend.drain(grace_s=10) == 0
        chunks, error = await running
        assert error is None and [c.finish_reason for c in chunks] == [None, "length"]
        assert inner.finished == ["r1"] and inner.aborted == []
        await backend.shutdown()
        assert inner.shut_down
    asyncio.run(scenario())


def test_end_in_flight_ends_requests_with_stopping_and_aborts_them():
    async def scenario():
        inner = ScriptedBackend()
        backend = DrainingBackend(inner)
        running = [asyncio.ensure_future(consume(backend, f"r{i}")) for i in range(3)]
        await until(lambda: backend.in_flight == 3)
        backend.begin_stop()
        assert await backend.drain(grace_s=0.1) == 3   # nobody finishes: the grace runs out
        await backend.end_in_flight()
        assert backend.in_flight == 0
        for chunks, error in await asyncio.gather(*running):
            assert [c.token_ids for c in chunks] == [(1,)]   # what it had, then the error
            assert isinstance(error, BackendUnavailable) and str(error) == STOPPING
        assert sorted(inner.aborted) == ["r0", "r1", "r2"] and inner.finished == []
    asyncio.run(scenario())


@pytest.mark.parametrize("stop_first", [False, True])
def test_a_consumer_that_leaves_closes_its_backend_stream(stop_first):
    async def scenario():
        inner = ScriptedBackend()
        backend = DrainingBackend(inner)
        stream = backend.generate(request("r"))
        assert (await anext(stream)).token_ids == (1,)
        if stop_first:  # begin_stop() leaves requests in flight alone
            backend.begin_stop()
        await stream.aclose()
        assert inner.aborted == ["r"] and backend.in_flight == 0
    asyncio.run(scenario())
