"""Glue between an engine (engine.LLMEngine) and the transfer plane, for prefill and decode workers.

kv_transfer does not import engine/: an engine is anything with the few methods of `PagedEngine`.

Prefill side (the thread that steps the engine):
    delta = ...                                  # last delta of a prefill_only request: kv_block_ids set
    handle = ship_prefilled(engine, sender, peer, request_id)    # the transfer now owns the blocks
Decode side (the thread that steps the engine):
    for outcome in receiver.poll():
        if isinstance(outcome, ReceivedKV):
            first = admit_received(engine, outcome, prompt_token_ids, params)   # the engine owns the blocks
A tensor-parallel engine (engine.tp_leader set) moves its KV through a full-head staging pool on rank 0
(kv_transfer/group_pool.py): sender_pool / receiver_pool give the view and the staging (None for one rank),
ship_prefilled stages the blocks out, land_delivered / drop_delivered take a delivery in or free it.
Decoder-side prefix reuse: the decode side pins the prompt's cached leading blocks first
(engine.pin_cached_prefix), the prefill side ships with prefix_blocks = their count (only the rest travels),
and admit_received(..., cached_block_ids=pins) puts the pins before the received blocks.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable, Protocol

from kv_transfer.config import ReceiverAddress
from kv_transfer.connector import KVSender
from kv_transfer.group_pool import GroupStaging
from kv_transfer.pool import KVPoolView
from kv_transfer.results import ReceivedKV, SendRequest, TransferHandle
from kv_transfer.token_logprobs import FirstTokenLogprobs


class PagedEngine(Protocol):
    """What the glue needs from an engine (engine.LLMEngine has all of it)."""

    kv_cache: Any  # .kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    model_config: Any  # .vocab_size

    def reserve_blocks(self, num_blocks: int) -> list[int] | None: ...

    def free_blocks(self, block_ids: Sequence[int]) -> None: ...

    def get_sequence(self, request_id: str) -> Any: ...

    def take_prefilled_blocks(self, request_id: str) -> list[int]: ...

    def abort(self, request_id: str) -> bool: ...

    def add_prefilled_request(self, request_id: str, prompt_token_ids: Sequence[int], first_token: int,
                              params: Any, block_ids: Sequence[int], arrival_time: float | None = None,
                              num_resumed_tokens: int = 0, first_logprobs: Any = None) -> Any: ...


def engine_pool_view(engine: PagedEngine,
                     allocate_for: Callable[[str, int], list[int] | None] | None = None) -> KVPoolView:
    """The engine's KV pool as the transfer plane sees it. allocate/free are the engine's thread-safe
    reserve_blocks/free_blocks, so sender and receiver threads may call them while another thread
    steps the engine; allocate_for (a decode worker's reservations) is passed through. The view changes
    nothing by itself."""
    return KVPoolView(engine.kv_cache.kv, engine.reserve_blocks, engine.free_blocks, allocate_for)


def sender_pool(engine: PagedEngine) -> tuple[KVPoolView, GroupStaging | None]:
    """The pool a prefill worker's KVSender reads: the engine's own, or a tensor-parallel engine's staging pool."""
    if getattr(engine, "tp_leader", None) is None:
        return engine_pool_view(engine), None
    staging = GroupStaging(engine)
    return staging.sender_view(), staging


def receiver_pool(engine: PagedEngine, allocate_for: Callable[[str, int], list[int] | None] | None = None
                  ) -> tuple[KVPoolView, GroupStaging | None]:
    """The pool a decode worker's KVReceiver lands in: the engine's own (engine_pool_view), or a tensor-parallel
    engine's staging pool whose blocks are paired with engine blocks from allocate_for (group_pool.py)."""
    if getattr(engine, "tp_leader", None) is None:
        return engine_pool_view(engine, allocate_for), None
    staging = GroupStaging(engine)
    return staging.receiver_view(allocate_for), staging


def land_delivered(received: ReceivedKV, staging: GroupStaging | None) -> ReceivedKV:
    """A delivery in the engine's own blocks: as is for one rank; a group's staging blocks written into their
    engine blocks (every rank its heads; a collective: on the thread that steps the engine)."""
    return received if staging is None else staging.land(received)


def drop_delivered(engine: PagedEngine, received: ReceivedKV, staging: GroupStaging | None) -> None:
    """Free a delivery nobody waits for (its engine blocks, and a group's staging blocks)."""
    if staging is None:
        engine.free_blocks(received.block_ids)
    else:
        staging.discard(received)


def take_prefilled(engine: PagedEngine, request_id: str, first_logprobs: Any = None,
                   prefix_blocks: int = 0) -> SendRequest:
    """Takes a finished prefill-only request out of the engine and describes its KV for a transfer.

    The request must be PREFILLED (its last delta carried kv_block_ids) and prefix_blocks (the leading
    prompt blocks the receiver already holds) fewer than its blocks; ValueError otherwise, and nothing
    changes. On return the caller owns the blocks after the first prefix_blocks (those go back to the
    engine's pool here, still in its prefix cache): it passes the SendRequest to KVSender.send (the
    transfer frees them) or frees them with engine.free_blocks. num_tokens is the prompt length (the first
    token has no KV yet); first_token is the token the prefill sampled; first_logprobs (the last delta's
    logprobs[0], an engine.sampling.logprobs.TokenLogprobs, when the request asked for them) travel with it. Call it
    on the thread that steps the engine.
    """
    seq = engine.get_sequence(request_id)
    if seq is None or seq.num_computed_tokens != seq.num_tokens - 1:
        raise ValueError(f"request {request_id!r} is not a prefilled request with exactly one sampled token")
    if isinstance(prefix_blocks, bool) or not isinstance(prefix_blocks, int) \
            or not 0 <= prefix_blocks < len(seq.block_table):
        raise ValueError(f"request {request_id!r}: prefix_blocks must be in [0, {len(seq.block_table)}), "
                         f"got {prefix_blocks!r}")
    num_tokens, first_token = seq.num_computed_tokens, seq.token_ids[-1]  # a resumed request's outputs too
    wire = None if first_logprobs is None else FirstTokenLogprobs.of(first_logprobs)
    block_ids = engine.take_prefilled_blocks(request_id)
    if prefix_blocks:
        engine.free_blocks(block_ids[:prefix_blocks])
    return SendRequest(request_id, tuple(block_ids[prefix_blocks:]), num_tokens, first_token, wire, prefix_blocks)


def ship_prefilled(engine: PagedEngine, sender: KVSender, peer: ReceiverAddress, request_id: str,
                   first_logprobs: Any = None, prefix_blocks: int = 0,
                   staging: GroupStaging | None = None) -> TransferHandle:
    """take_prefilled + sender.send: the request leaves the engine and its blocks go to the transfer,
    which frees them exactly once when it ends (handle resolved or failed); the first prefix_blocks, which
    the receiver holds already, do not travel (freed at once). staging (a tensor-parallel engine's, from
    sender_pool): the blocks' KV is staged out first and the transfer sends and frees the staging blocks. If
    staging or send() raises (no staging room, a bad peer address) every block is freed here before the exception
    propagates."""
    request = take_prefilled(engine, request_id, first_logprobs, prefix_blocks)
    free = engine.free_blocks
    if staging is not None:  # stage_out frees the engine blocks, whatever happens
        staged = staging.stage_out(request.block_ids)
        request, free = dataclasses.replace(request, block_ids=tuple(staged)), staging.free
    try:
        return sender.send(peer, request)
    except BaseException:
        free(request.block_ids)
        raise


def admit_received(engine: PagedEngine, received: ReceivedKV, prompt_token_ids: Sequence[int], params: Any,
                   arrival_time: float | None = None, num_resumed_tokens: int = 0,
                   cached_block_ids: Sequence[int] = ()) -> Any:
    """Admits a delivered transfer as a prefilled request; returns the first token's StepDelta.

    The prompt must be the one the manifest describes (same length); the first token comes from the
    manifest (for a resumed request: the prompt and the tokens generated before, the last
    num_resumed_tokens), with its logprobs when the prefill reported them. cached_block_ids: the blocks of
    the prompt's first manifest.prefix_blocks blocks this side already held (pinned for the request: one
    reference each, which the caller hands over here); the sequence's blocks are cached_block_ids then
    received.block_ids. On success the engine's sequence owns all of them (freed when it ends). On any
    error (ValueError: a length or prefix mismatch, a bad or duplicate request) every block handed in
    (received and cached) is freed here and the exception propagates, so no path leaks them. Call it on the
    thread that steps the engine.
    """
    manifest = received.manifest
    block_ids = tuple(cached_block_ids) + tuple(received.block_ids)
    try:
        if len(prompt_token_ids) != manifest.num_tokens:
            raise ValueError(f"request {manifest.request_id!r}: the prompt has {len(prompt_token_ids)} tokens, "
                             f"the transferred KV holds {manifest.num_tokens}")
        if len(cached_block_ids) != manifest.prefix_blocks:
            raise ValueError(f"request {manifest.request_id!r}: the KV skips the first {manifest.prefix_blocks} "
                             f"blocks, this side holds {len(cached_block_ids)} of them")
        if not 0 <= manifest.first_token < engine.model_config.vocab_size:
            raise ValueError(f"request {manifest.request_id!r}: first token {manifest.first_token} is outside "
                             f"the vocabulary")
        return engine.add_prefilled_request(manifest.request_id, prompt_token_ids, manifest.first_token, params,
                                            block_ids, arrival_time=arrival_time,
                                            num_resumed_tokens=num_resumed_tokens,
                                            first_logprobs=manifest.first_logprobs)
    except BaseException:
        _release_after_failed_admission(engine, manifest.request_id, block_ids)
        raise


def _release_after_failed_admission(engine: PagedEngine, request_id: str, block_ids: Sequence[int]) -> None:
    """Frees the blocks once: through abort if the engine already holds a sequence built on them,
    directly otherwise (a same-named request with other blocks is left alone)."""
    seq = engine.get_sequence(request_id)
    if seq is not None and list(seq.block_table[:len(block_ids)]) == list(block_ids):
        engine.abort(request_id)
    else:
        engine.free_blocks(block_ids)
