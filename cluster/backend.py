"""The contract between the front ends (gRPC, HTTP) and whatever generates tokens behind them.

The front ends validate and translate wire requests into a GenerationRequest, iterate the chunks a
Backend streams back, and translate those into wire responses. A Backend is either one engine in this
process (LocalEngineBackend: the colocated single-worker case and the tests) or the coordinator of
prefill and decode workers on Ray. Front ends never see engines, workers or Ray.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from engine.sampling.logprobs import TokenLogprobs
from engine.sampling_params import SamplingParams


class BackendOverloaded(Exception):
    """The backend refuses new work for now (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""


class BackendUnavailable(Exception):
    """The backend cannot serve at all (no live workers): gRPC UNAVAILABLE, HTTP 503."""


class InvalidField(ValueError):
    """Bad input in one named field (`field`, e.g. "messages[0].role"): HTTP 400 with it as the error's
    `param`, gRPC INVALID_ARGUMENT; the message names it too."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ScaleRefused(ValueError):
    """A change of the worker set that is not allowed (HTTP 400); nothing changed. `field`: the field of
    the admin request at fault ("role" or "delta")."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: token ids already encoded, sampling params already checked."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float  # time.perf_counter() when the front end received it


@dataclass(frozen=True)
class Timing:
    """Per-stage breakdown of one request, in milliseconds (gRPC `Timing`, HTTP `tandem_timing`).

    ttft_ms runs from arrival at the front end to the first token handed back to it, KV transfer
    included. transfer_ms runs from the transfer's first byte to its acknowledgement; with layer-wise
    streaming it overlaps prefill_ms, and transfer_exposed_ms is the part the client waits for (the
    prefill step end -> KV landed on the decode worker): ttft ~ queue + prefill + exposed transfer +
    delivery. In colocated serving the transfer fields and kv_bytes are 0. migrations: how often the
    request moved to other workers after a worker under it failed (the workers named are the last ones).
    prefill_location: where the prompt was prefilled, "remote" (a prefill worker; its KV moved) or "local"
    (its decode worker or replica: the disaggregation policy's decision), "" for the in-process engine.
    decode_cached_tokens: leading prompt tokens whose KV the decode worker already held in its prefix cache
    (remote: they did not travel, kv_bytes counts only the rest)."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    transfer_exposed_ms: float = 0.0
    ttft_ms: float = 0.0
    kv_bytes: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    migrations: int = 0
    prefill_location: str = ""
    decode_cached_tokens: int = 0


@dataclass(frozen=True)
class GenerationChunk:
    """New tokens and stable text since the previous chunk of one sample; a sample's last chunk has
    finish_reason ("stop" or "length") and timing set. logprobs: one engine.sampling.logprobs.TokenLogprobs per token
    of token_ids when the request asked for logprobs (SamplingParams.logprobs), else None. index: which of
    the request's SamplingParams.n samples (0..n-1) the chunk belongs to; the stream ends after each sample's
    last chunk. prompt_logprobs: with SamplingParams.prompt_logprobs, on each sample's first chunk, one per
    prompt token (the first None; engine/sampling/prompt_logprobs.py)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    timing: Timing | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    index: int = 0
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass(frozen=True)
class BackendHealth:
    serving: bool
    model: str
    prefill_workers: int
    decode_workers: int
    details: dict = field(default_factory=dict)


class Backend(Protocol):
    """What a front end needs. All methods are called from the front end's asyncio loop."""

    model_name: str
    max_model_len: int

    @property
    def tokenizer(self):
        """The engine.text.tokenizer.Tokenizer of the served model (encode prompts, chat templates)."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the request's chunks. Raises BackendOverloaded / BackendUnavailable before the first
        chunk if it cannot take the request, ValueError for input the engine rejects. If the consumer
        stops iterating early (client cancel), the request is aborted and every block it held is freed."""

    async def health(self) -> BackendHealth:
        """Whether the backend serves, and what with."""

    async def shutdown(self) -> None:
        """Abort everything in flight, free all blocks, stop background threads."""


class WorkerScaling(Protocol):
    """The admin surface of a backend whose workers can be added and drained while it serves (the
    coordinator of replicas or of disaggregated workers: cluster/coordinator/scaling.py). Called from the
    front end's asyncio loop."""

    roles: tuple[str, ...]   # the roles a change may name: ("prefill", "decode") or ("replica",)

    def describe(self) -> dict:
        """{"workers": {name: {"role", "state"}}, "bounds": {role: {"min", "max"}}}. Changes nothing."""

    async def scale(self, role: str, delta: int) -> dict:
        """Add `delta` workers of `role` (returns once they serve) or drain -delta of them (returns once
        they no longer take requests; each stops when its requests have ended). ScaleRefused (nothing
        changes) for an unknown role, a delta of 0, or a count outside the bounds or past what the
        cluster's resources hold; BackendUnavailable (nothing changes) when a worker failed to start."""
