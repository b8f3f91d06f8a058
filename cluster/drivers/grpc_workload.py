"""Drive a Tandem gRPC front end with concurrent requests and measure them at the client.

Shared by the serving demo (cluster/drivers/serving_demo.py) and the Ray job entrypoint (deploy/job.py): each
request streams through the real `tandem.v1.Tandem/Generate` stub; the client stamps every chunk's
arrival, so TTFT and inter-token latency (ITL) are what a caller sees, and keeps the server-side
`timing` of the final message (queue / prefill / transfer breakdown, KV bytes).
"""
from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from proto import tandem_pb2, tandem_pb2_grpc

SHORT_QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What does a GPU do, in one sentence?",
    "Give me a synonym for happy.",
    "How many days are there in a week?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a friendly robot.",
)
LONG_CONTEXT = (
    "Large language model serving has two phases. Prefill reads the whole prompt at once and is limited by "
    "compute; decode writes one token at a time for every running request and is limited by memory bandwidth. "
    "When both share one GPU, a long prefill stalls every decode behind it, so the time between tokens jumps. "
    "Disaggregated serving runs prefill and decode on different workers: a prefill worker ingests prompts in "
    "packed batches, then ships the key-value cache of each prompt to a decode worker, which generates the answer "
    "with continuous batching over a paged cache. The cost is the transfer of that cache between the workers. "
)
LONG_CONTEXT_CHARS = (600, 900, 1200)
Render = Callable[[str], str]  # a user message -> the prompt text (a chat template), or the message as it is


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: its id, the user's message, the prompt text sent (the message rendered
    with the model's chat template) and how many tokens to generate at most."""

    request_id: str
    question: str
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class RequestResult:
    """What the client saw for one request. ttft_ms is measured at the client (send -> first token);
    token_gaps_ms are the gaps between consecutive streamed tokens (a chunk of k tokens counts as one
    gap followed by k-1 zero gaps); timing is the server's final `Timing` message (None on error)."""

    request_id: str
    prompt_chars: int
    output_tokens: int
    ttft_ms: float
    elapsed_s: float
    token_gaps_ms: tuple[float, ...] = ()
    timing: tandem_pb2.Timing | None = None
    error: str | None = None
    text: str = ""


@dataclass(frozen=True)
class WorkloadSummary:
    """Aggregates of one workload run (latencies in ms)."""

    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    tokens_per_s: float
    transfer_share_p50: float
    kv_bytes: int
    failed: int = 0


def mixed_workload(num_requests: int = 12, max_tokens: int = 24, render: Render | None = None
                   ) -> list[WorkloadRequest]:
    """Mostly short questions plus, in every four requests, one long text to summarize (600-1200 characters);
    render turns each message into the prompt sent (default: the message itself)."""
    requests = []
    for index in range(num_requests):
        if index % 4 == 3:
            chars = LONG_CONTEXT_CHARS[(index // 4) % len(LONG_CONTEXT_CHARS)]
            question = (LONG_CONTEXT * 4)[:chars] + "\nSummarize the text above in one sentence."
        else:
            question = SHORT_QUESTIONS[index % len(SHORT_QUESTIONS)]
        prompt = question if render is None else render(question)
        requests.append(WorkloadRequest(f"req-{index:02d}", question, prompt, max_tokens))
    return requests


def chat_renderer(model: str | None) -> Render | None:
    """How a user message becomes a prompt for `model` (as engine.builder resolves it): its tokenizer's chat
    template with the assistant's turn opened; None when the model has none (the embedded tiny model)."""
    from engine.builder import load_tokenizer
    tokenizer = load_tokenizer(model)
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    return lambda message: tokenizer.apply_chat_template([{"role": "user", "content": message}])


async def run_one(stub: tandem_pb2_grpc.TandemStub, request: WorkloadRequest) -> RequestResult:
    """Stream one request greedily, until the model's end of answer or max_tokens."""
    message = tandem_pb2.GenerateRequest(request_id=request.request_id, prompt=request.prompt,
                                         max_tokens=request.max_tokens, temperature=0.0)
    sent = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    last = None
    try:
        async for response in stub.Generate(message):
            now = time.perf_counter()
            arrivals += [now] * len(response.token_ids)
            pieces.append(response.text)
            last = response
    except grpc.RpcError as error:
        return RequestResult(request.request_id, len(request.prompt), len(arrivals), 0.0,
                             time.perf_counter() - sent, error=f"{error.code().name}: {error.details()}")
    elapsed = time.perf_counter() - sent
    ttft_ms = (arrivals[0] - sent) * 1e3 if arrivals else 0.0
    gaps = tuple((b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:]))
    timing = last.timing if last is not None and last.HasField("timing") else None
    return RequestResult(request.request_id, len(request.prompt), len(arrivals), ttft_ms, elapsed, gaps, timing,
                         text="".join(pieces))


async def run_workload(target: str, requests: list[WorkloadRequest]) -> tuple[list[RequestResult], float]:
    """Send every request at once over one channel; returns the results (in request order) and the
    wall time of the whole run in seconds."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = tandem_pb2_grpc.TandemStub(channel)
        started = time.perf_counter()
        results = await asyncio.gather(*(run_one(stub, r) for r in requests))
        return list(results), time.perf_counter() - started


def percentile(values, fraction: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = min(len(ordered) - 1, max(0, int(round(fraction * len(ordered) + 0.5)) - 1))
    return ordered[rank]


def summarize(results: list[RequestResult], wall_s: float) -> WorkloadSummary:
    """TTFT / ITL percentiles, generated tokens per wall second, and the median share of TTFT spent waiting
    for the KV transfer (its exposed part: a layer-streamed transfer mostly runs under the prefill)."""
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_ms for r in ok]
    gaps = [g for r in ok for g in r.token_gaps_ms]
    shares = [r.timing.transfer_exposed_ms / r.timing.ttft_ms for r in ok
              if r.timing is not None and r.timing.ttft_ms > 0]
    tokens = sum(r.output_tokens for r in ok)
    kv_bytes = sum(r.timing.kv_bytes for r in ok if r.timing is not None)
    return WorkloadSummary(percentile(ttfts, 0.5), percentile(ttfts, 0.99), percentile(gaps, 0.5),
                           percentile(gaps, 0.99), tokens / wall_s if wall_s > 0 else 0.0,
                           statistics.median(shares) if shares else 0.0, kv_bytes, len(results) - len(ok))
