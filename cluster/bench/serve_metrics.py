"""Metrics of a `tandem bench serve` run, with `vllm bench serve`'s definitions.

TTFT: send -> first chunk carrying tokens. TPOT: (e2e - ttft) / (output_tokens - 1), only for requests
with more than one output token. ITL: the gaps between consecutive token-carrying chunks of each
request, pooled over requests; like vLLM, a chunk carrying several tokens contributes ONE gap (the
time since the previous chunk), not one per token. E2E: send -> last chunk. Percentiles are numpy's
linear ones; std is the population std (np.std), as in vLLM. Goodput: successful requests meeting
every given SLO, per second of the run (a request with <= 1 output token has TPOT 0 for this test).
"""
from __future__ import annotations

import dataclasses

import numpy as np

PERCENTILES = (50, 90, 99)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclasses.dataclass(frozen=True)
class RequestResult:
    """What the client saw of one request. Times are time.perf_counter() seconds."""

    success: bool
    prompt_len: int
    send_time: float = 0.0
    chunk_times: tuple[float, ...] = ()
    chunk_token_counts: tuple[int, ...] = ()
    error: str = ""
    timing: dict | None = None
    output_token_ids: tuple[int, ...] = ()
    turn: int = 0  # multiturn: the turn of its conversation, 1 first (0: not a conversation's turn)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_token_counts)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.send_time

    @property
    def itls(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float:
        """vLLM's TPOT; 0 for a request with <= 1 output token (vLLM's goodput convention)."""
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclasses.dataclass(frozen=True)
class Distribution:
    """mean / median / std / p90 / p99 of one latency metric, in milliseconds (0 when empty)."""

    mean: float
    median: float
    std: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values: list[float]) -> "Distribution":
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0)
        ms = np.asarray(values, dtype=float) * 1000
        return cls(float(np.mean(ms)), float(np.median(ms)), float(np.std(ms)),
                   float(np.percentile(ms, 90)), float(np.percentile(ms, 99)))


@dataclasses.dataclass(frozen=True)
class DisaggMetrics:
    """Stage breakdown from the servers' tandem_timing: ms percentiles, KV size and speed, and the
    share of the client-measured TTFT spent waiting for the KV transfer (per request, then p50 / p99): its
    exposed part (transfer_exposed_ms), since a layer-streamed transfer mostly runs under the prefill."""

    requests_with_timing: int
    queue_ms_p50: float
    queue_ms_p99: float
    prefill_ms_p50: float
    prefill_ms_p99: float
    transfer_ms_p50: float
    transfer_ms_p99: float
    mean_kv_bytes: float
    transfer_gb_per_s: float
    transfer_share_of_ttft_p50: float
    transfer_share_of_ttft_p99: float
    transfer_exposed_ms_p50: float = 0.0
    transfer_exposed_ms_p99: float = 0.0


@dataclasses.dataclass(frozen=True)
class BenchmarkMetrics:
    """The result of one run; field names are vLLM's result-JSON keys where vLLM has them."""

    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    disagg: DisaggMetrics


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds); ValueError if bad."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        name, _, value = spec.partition(":")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput: unknown metric {name!r} (use {', '.join(GOODPUT_METRICS)})")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {spec!r} is not NAME:MILLISECONDS") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput: {spec!r} must not be negative")
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """True if every given SLO (ms) holds for the request: value <= SLO, as vLLM's goodput counts."""
    values = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.e2el}
    return all(values[name] * 1000 <= slo for name, slo in slos.items())


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def disagg_metrics(done: list[RequestResult]) -> DisaggMetrics:
    """DisaggMetrics over the successful requests that carried a tandem_timing."""
    timings = [(result, result.timing) for result in done if result.timing]
    field = lambda name: [float(timing.get(name, 0.0)) for _, timing in timings]  # noqa: E731
    queue, prefill, transfer = field("queue_ms"), field("prefill_ms"), field("transfer_ms")
    kv_bytes, exposed = field("kv_bytes"), field("transfer_exposed_ms")
    shares = [timing.get("transfer_exposed_ms", 0.0) / (result.ttft * 1000) for result, timing in timings
              if result.ttft > 0]
    transfer_s = sum(transfer) / 1000
    return DisaggMetrics(
        len(timings), percentile(queue, 50), percentile(queue, 99), percentile(prefill, 50),
        percentile(prefill, 99), percentile(transfer, 50), percentile(transfer, 99),
        float(np.mean(kv_bytes)) if kv_bytes else 0.0,
        sum(kv_bytes) / transfer_s / 1e9 if transfer_s > 0 else 0.0,
        percentile(shares, 50), percentile(shares, 99), percentile(exposed, 50), percentile(exposed, 99))


def compute_metrics(results: list[RequestResult], duration: float,
                    slos: dict[str, float] | None = None) -> BenchmarkMetrics:
    """BenchmarkMetrics of a run lasting `duration` seconds; failed requests count only in `failed`."""
    done = [result for result in results if result.success and result.chunk_times]
    total_input = sum(result.prompt_len for result in done)
    total_output = sum(result.output_tokens for result in done)
    good = sum(meets_slos(result, slos) for result in done) if slos else 0
    per_second = (lambda count: count / duration) if duration > 0 else (lambda count: 0.0)
    return BenchmarkMetrics(
        completed=len(done), failed=len(results) - len(done), duration=duration,
        total_input_tokens=total_input, total_output_tokens=total_output,
        request_throughput=per_second(len(done)), output_throughput=per_second(total_output),
        total_token_throughput=per_second(total_input + total_output),
        request_goodput=per_second(good) if slos else None,
        ttft=Distribution.of_seconds([result.ttft for result in done]),
        tpot=Distribution.of_seconds([result.tpot for result in done if result.output_tokens > 1]),
        itl=Distribution.of_seconds([gap for result in done for gap in result.itls]),
        e2el=Distribution.of_seconds([result.e2el for result in done]),
        disagg=disagg_metrics(done))
