"""The HTTP side of `tandem bench serve`: streamed /v1/completions requests sent on a schedule.

Each request is POST /v1/completions with stream=true, return_token_ids=true, temperature 0 and
max_tokens = its output length. Every SSE chunk carrying tokens is timed on arrival (chunks with no
token ids, such as a usage-only chunk, are not); the last chunk's `tandem_timing` is kept. An HTTP
error status, a broken connection or an `error` event makes the request failed; the run goes on.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from typing import Callable

import aiohttp
from tqdm import tqdm

from cluster.bench.serve_metrics import RequestResult
from cluster.bench.serve_workloads import SampleRequest


class ServerUnreachable(Exception):
    """The server did not answer GET /v1/models."""


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """Where and how to send requests."""

    base_url: str
    model: str | None = None
    ignore_eos: bool = True
    max_concurrency: int | None = None
    timeout_s: float = 600.0
    show_progress: bool = False


async def served_context(base_url: str, model: str | None) -> int | None:
    """max_model_len of `model` (default: the first model) as GET /v1/models lists it (vLLM's field); None
    when the server does not say or does not answer (the run itself then reports it unreachable)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.get(f"{base_url}/v1/models") as response:
                response.raise_for_status()
                cards = (await response.json())["data"]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError, TypeError):
        return None
    card = next((c for c in cards if model is None or c.get("id") == model), None)
    length = card.get("max_model_len") if isinstance(card, dict) else None
    return length if isinstance(length, int) and not isinstance(length, bool) else None


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id GET /v1/models lists; ServerUnreachable if the server does not answer."""
    try:
        async with session.get(f"{base_url}/v1/models") as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as error:
        raise ServerUnreachable(f"cannot reach a Tandem/OpenAI server at {base_url}: "
                                f"{type(error).__name__}: {error}") from error


def _request_body(sample: SampleRequest, model: str, ignore_eos: bool) -> dict:
    body = {"model": model, "prompt": list(sample.prompt_token_ids), "max_tokens": sample.output_len,
            "temperature": 0, "stream": True, "return_token_ids": True, "ignore_eos": ignore_eos}
    if sample.structured_outputs is not None:
        body["structured_outputs"] = sample.structured_outputs
    return body


async def _read_events(response: aiohttp.ClientResponse):
    """Yields (arrival time, parsed JSON) of each `data:` event until [DONE] or the end."""
    async for raw_line in response.content:
        line = raw_line.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield time.perf_counter(), json.loads(data)


async def send_request(session: aiohttp.ClientSession, config: ClientConfig, model: str,
                       sample: SampleRequest) -> RequestResult:
    """Sends one streamed completion and returns what was seen of it; never raises for server errors."""
    times, counts, timing, output = [], [], None, []
    failed = lambda error: RequestResult(False, len(sample.prompt_token_ids), send_time, tuple(times),  # noqa: E731
                                         tuple(counts), error, timing, tuple(output))
    send_time = time.perf_counter()
    try:
        async with session.post(f"{config.base_url}/v1/completions",
                                json=_request_body(sample, model, config.ignore_eos)) as response:
            if response.status != 200:
                return failed(f"HTTP {response.status}: {(await response.text())[:200]}")
            async for arrival, event in _read_events(response):
                if "error" in event:
                    return failed(f"error event: {event['error']}")
                choices = event.get("choices") or []
                token_ids = choices[0].get("token_ids") or [] if choices else []
                if token_ids:
                    times.append(arrival)
                    counts.append(len(token_ids))
                    output += token_ids
                timing = event.get("tandem_timing") or timing
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
        return failed(f"{type(error).__name__}: {error}")
    if not times:
        return failed("no tokens received")
    return RequestResult(True, len(sample.prompt_token_ids), send_time, tuple(times), tuple(counts), "",
                         timing, tuple(output))


async def _paced(samples: list[SampleRequest], gaps: list[float]):
    for sample, gap in zip(samples, gaps):
        if gap > 0:
            await asyncio.sleep(gap)
        yield sample


async def run_requests(config: ClientConfig, samples: list[SampleRequest], gaps: list[float],
                       warmups: list[SampleRequest],
                       on_sent: Callable[[int], None] | None = None) -> tuple[str, list[RequestResult], float]:
    """Sends `warmups` (unmeasured, all at once), then `samples` on the `gaps` schedule with at most
    max_concurrency in flight; on_sent(n) after the n-th measured request was started. Returns (model,
    results in send order, duration of the measured part)."""
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        listed = await served_model(session, config.base_url)  # fails clearly if nothing answers
        model = config.model or listed
        await asyncio.gather(*(send_request(session, config, model, sample) for sample in warmups))
        limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        progress = tqdm(total=len(samples), disable=not config.show_progress, desc="requests")

        async def limited(sample: SampleRequest) -> RequestResult:
            async with limit if limit else contextlib.nullcontext():
                result = await send_request(session, config, model, sample)
            progress.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        async for sample in _paced(samples, gaps):
            tasks.append(asyncio.create_task(limited(sample)))
            if on_sent is not None:
                on_sent(len(tasks))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        progress.close()
    return model, list(results), duration
