"""What goes into a prefill worker (PrefillTask) and what comes out (PrefillReport, PrefillStats).

Plain frozen dataclasses: they cross process boundaries as they are (pickled by Ray or a pipe).
Times are the worker's own `time.time()` seconds; only differences taken inside one report are meaningful
to another process (queue_ms, prefill_ms, transfer_ms).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from engine.sampling.logprobs import TokenLogprobs
from engine.sampling_params import SamplingParams
from kv_transfer.config import ReceiverAddress


class PrefillStatus(str, Enum):
    SHIPPED = "shipped"              # first token sampled, KV acknowledged by the decode worker
    FINISHED = "finished"            # the first token ended the request (max_tokens=1, EOS, stop): nothing shipped
    INVALID = "invalid"              # the engine rejected the input (error says why); nothing was admitted
    CANCELLED = "cancelled"          # cancel() or stop() ended it; everything it held is freed
    TRANSFER_FAILED = "transfer_failed"  # the KV did not reach the decode worker; the blocks are freed
    FAILED = "failed"                # an engine step failed


@dataclass(frozen=True)
class PrefillTask:
    """Prefill `prompt_token_ids`, sample the first token with `params`, ship the KV to `decode_address`.
    num_resumed_tokens > 0: the last that many prompt_token_ids were generated before (a resumed request).
    decode_cached_blocks: the prompt's leading full blocks the decode worker already holds (pinned there,
    Admission.cached_blocks): the whole prompt is still prefilled here (attention needs all of it; this
    worker's own prefix cache saves what it can), but only the blocks after these are shipped."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    decode_address: ReceiverAddress
    num_resumed_tokens: int = 0
    decode_cached_blocks: int = 0

    def check_cached_blocks(self, block_size: int) -> None:
        """ValueError unless decode_cached_blocks leaves the block of the prompt's last token to ship."""
        most = max(0, len(self.prompt_token_ids) - 1) // block_size
        cached = self.decode_cached_blocks
        if isinstance(cached, bool) or not isinstance(cached, int) or not 0 <= cached <= most:
            raise ValueError(f"decode_cached_blocks must be in [0, {most}] for a prompt of "
                             f"{len(self.prompt_token_ids)} tokens, got {cached!r}")


@dataclass(frozen=True)
class PrefillReport:
    """The one answer to a PrefillTask. first_token / text are set once the prefill sampled (SHIPPED,
    FINISHED, and a TRANSFER_FAILED or CANCELLED after sampling), with first_logprobs when the request
    asked for logprobs (they also travel to the decode worker in the KV manifest); finish_reason only
    for FINISHED. prompt_logprobs: with the sampled first token, when the task asked for them
    (SamplingParams.prompt_logprobs: one per prompt token, the first None); they come back here only."""

    request_id: str
    status: PrefillStatus
    worker: str
    received_at: float
    first_token: int | None = None
    text: str = ""
    first_logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    finish_reason: str | None = None
    prefill_started: float | None = None
    prefill_ended: float | None = None
    forward_ended: float | None = None  # the prompt's last layer was computed (layer-streamed; else prefill_ended)
    transfer_started: float | None = None
    transfer_ended: float | None = None
    kv_bytes: int = 0
    num_cached_tokens: int = 0
    error: str = ""

    @property
    def queue_ms(self) -> float:
        """Received -> first scheduled in a step."""
        return _ms(self.received_at, self.prefill_started)

    @property
    def prefill_ms(self) -> float:
        """First scheduled -> first token sampled."""
        return _ms(self.prefill_started, self.prefill_ended)

    @property
    def transfer_ms(self) -> float:
        """send() -> the decode worker's final acknowledgement (or the failure). Layer-streamed, the send
        starts before the forward, so this overlaps prefill_ms."""
        return _ms(self.transfer_started, self.transfer_ended)

    @property
    def transfer_exposed_ms(self) -> float:
        """The part of the transfer the client waits for: the prefill step's end (last layer computed and
        first token sampled, where prefill_ms ends) -> the decode worker's acknowledgement of the landed KV
        (for a whole-request send, any wait for a transfer slot included). Not from forward_ended: the LM
        head and sampling after the last layer are prefill, not transfer."""
        return _ms(self.prefill_ended, self.transfer_ended)


def _ms(start: float | None, end: float | None) -> float:
    if start is None or end is None:
        return 0.0
    return max(0.0, end - start) * 1e3


@dataclass(frozen=True)
class PrefillStats:
    """A snapshot the step thread publishes after every iteration."""

    name: str
    queued_tokens: int         # prompt tokens admitted and not yet computed
    live_requests: int         # tasks not yet reported (queued, prefilling or shipping)
    transfers_in_flight: int
    engine_requests: int       # requests the engine itself still holds
    free_blocks: int
    total_blocks: int
    staging_free: int = 0      # a tensor-parallel worker's full-head staging blocks (kv_transfer/group_pool.py)
    staging_total: int = 0
    lane_transfers: int = 0    # transfers a tensor-parallel worker delivered by KV lanes (kv_transfer/lanes/)


def collect_stats(name: str, engine: Any, lives: Iterable[tuple[str, Any]], staging: Any = None,
                  lane_transfers: int = 0) -> PrefillStats:
    """The worker's load now: prompt tokens its engine has not computed yet (tasks not on the wire), tasks
    live and shipping, and the engine's requests and blocks. Reads only."""
    queued = shipping = live_requests = 0
    for request_id, live in lives:
        live_requests += 1
        shipping += live.handle is not None
        seq = engine.get_sequence(request_id) if live.handle is None else None
        if seq is not None:
            queued += max(0, seq.num_tokens - seq.num_computed_tokens)
    staged = (staging.num_free, staging.num_blocks) if staging else (0, 0)
    return PrefillStats(name, queued, live_requests, shipping, engine.num_live_requests, engine.num_free_blocks,
                        engine.num_total_blocks, *staged, lane_transfers)
