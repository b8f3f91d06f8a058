"""What goes into a decode worker (ExpectedRequest) and what comes out (Admission, DecodeChunk,
DecodeEnded, DecodeStats). Frozen dataclasses: they cross process boundaries as they are."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Union

from engine.sampling.logprobs import TokenLogprobs
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ExpectedRequest:
    """A request whose prompt KV a prefill worker is about to send here (same request_id), or, with
    prefill_locally, a short prompt this worker prefills itself (conditional disaggregation).
    local_below_uncached_tokens > 0: the worker decides itself, after matching the prompt in its prefix
    cache: it prefills locally when fewer prompt tokens than this are left uncached (the coordinator's
    policy, cluster/coordinator/disagg_policy.py, chose the bound); Admission.prefill_locally says what it
    chose. num_resumed_tokens > 0: a request that continues here after its decode worker died; the last that
    many prompt_token_ids are the tokens already generated (and streamed) before."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    prefill_locally: bool = False
    num_resumed_tokens: int = 0
    local_below_uncached_tokens: int = 0


@dataclass(frozen=True)
class Admission:
    """The answer to expect(): accepted, or refused (backpressure: retry elsewhere or later).
    cached_blocks: leading full prompt blocks this worker holds in its prefix cache and pinned for the
    request (the KV transfer skips them; PrefillTask.decode_cached_blocks). prefill_locally: the request is
    prefilled here (asked for, or chosen by local_below_uncached_tokens): no KV will be expected. for_room: refused
    for lack of room (the KV pool cannot spare the prompt's blocks, or the live-request limit is reached), which a
    request ending here frees; a refusal without it (the worker is stopping, the id is live) does not pass."""

    accepted: bool
    reason: str = ""
    cached_blocks: int = 0
    prefill_locally: bool = False
    for_room: bool = False


@dataclass(frozen=True)
class DecodeChunk:
    """New tokens and stable text of one request; the first one carries the prefill's first token, the
    last one has finish_reason ("stop" | "length"). logprobs: one per token when the request asked.
    prompt_logprobs: on the first chunk of a request this worker prefilled itself that asked for them
    (SamplingParams.prompt_logprobs); a request prefilled elsewhere gets them from its prefill worker."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    @classmethod
    def of(cls, delta) -> "DecodeChunk":
        """The chunk of an engine StepDelta."""
        return cls(delta.request_id, delta.new_token_ids, delta.new_text, delta.finish_reason, delta.logprobs,
                   delta.prompt_logprobs)


class DecodeStatus(str, Enum):
    CANCELLED = "cancelled"            # cancel() ended it
    TIMEOUT = "timeout"                # its KV did not arrive within expect_timeout_s
    TRANSFER_FAILED = "transfer_failed"  # the receiver gave up on its KV (message says why)
    NO_ROOM = "no_room"                # its KV found no room in the pool (overload: retry later)
    INVALID = "invalid"                # admission rejected the KV (e.g. prompt length mismatch)
    FAILED = "failed"                  # an engine step failed
    SHUTDOWN = "shutdown"              # the worker stopped


@dataclass(frozen=True)
class DecodeEnded:
    """The request ended without a finish_reason; everything it held is freed."""

    request_id: str
    status: DecodeStatus
    message: str = ""


DecodeEvent = Union[DecodeChunk, DecodeEnded]
EmitEvent = Callable[[DecodeEvent], None]


def is_final(event: DecodeEvent) -> bool:
    """Whether `event` is the last one of its request."""
    return isinstance(event, DecodeEnded) or event.finish_reason is not None


@dataclass(frozen=True)
class DecodeStats:
    """A snapshot the step thread publishes after every iteration (plus the admission counters)."""

    name: str
    running: int            # admitted into the engine (decoding)
    waiting: int            # expected, KV not yet admitted
    engine_requests: int    # requests the engine itself holds
    free_blocks: int
    total_blocks: int
    promised_blocks: int    # prompt blocks promised to expected requests
    dropped_connections: int = 0  # peers its listeners (KV receiver, decode channel) dropped: no secret, ...
    staging_free: int = 0   # a tensor-parallel worker's full-head staging blocks (kv_transfer/group_pool.py)
    staging_total: int = 0
