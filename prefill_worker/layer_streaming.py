"""Layer-wise KV streaming on the prefill worker: the engine step's observer (kv_streaming="layer").

Before a step's forward, every prefill-only request that the step completes and whose decode worker has a
free transfer slot gets a layer-streamed send (kv_transfer/layer_stream.py): the transfer sends layer l as
soon as the forward has written it, so most of the KV is on the wire while the rest of the model runs.
After the step the worker completes each stream (`complete`): the sampled first token follows the last
layer and the blocks pass from the engine to the transfer, or the stream is aborted when the first token
ended the request. A request without a free slot is sent whole after the step, as with "request".
A worker with KV lanes streams a request to a decode worker with lanes from every rank (kv_transfer/lanes/
group_sender.py): the engine's blocks travel, no staging; other peers stream through rank 0's staging pool
(prefill_worker/group_streams.py).

Step thread only, like the worker that owns it.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from engine.core.llm_engine import LLMEngine
from engine.outputs import StepDelta
from engine.sequence import Sequence
from kv_transfer import KVSender, SendRequest, TransferHandle
from kv_transfer.engine_pool import take_prefilled
from kv_transfer.group_pool import GroupStaging
from kv_transfer.lanes import LaneSender
from kv_transfer.layer_stream import LayerClock, LayerStream, StreamTail
from prefill_worker.group_streams import GroupStreams
from prefill_worker.transfer_slots import TransferSlots


class LayerStreaming:
    """Starts and completes the layer-streamed sends of the worker's requests (engine.StepObserver).

    lives: the worker's live tasks by request id (each with .task, .report, .handle, .stream, .cancelled);
    on_sent(request_id, handle): the worker's hook for a started send (it watches the handle)."""

    def __init__(self, engine: LLMEngine, sender: KVSender, slots: TransferSlots, lives: dict[str, Any],
                 on_sent: Callable[[str, TransferHandle], None], staging: GroupStaging | None = None,
                 lanes: LaneSender | None = None) -> None:
        """staging: a tensor-parallel engine's (kv_transfer/group_pool.py): the streams send its blocks. lanes: its
        lane sender, when it has lanes: a stream to a decode worker with lanes goes by lanes instead."""
        self._engine, self._sender, self._slots, self._lives, self._on_sent = engine, sender, slots, lives, on_sent
        self._clock: LayerClock | None = None
        self._group = GroupStreams(staging) if staging is not None else None
        self._lanes = lanes
        self._by_lanes: set[str] = set()  # requests streaming by lanes until complete()

    def forward_starting(self, completing: list[Sequence]) -> Callable[[int], None] | None:
        """Starts a stream for each completing request that can have one; the clock's callback if any did."""
        clock = LayerClock(self._engine.model_config.num_layers, self._engine.device)
        started = [seq for seq in completing if self._start(seq, clock)]
        self._clock = clock if started else None
        if not started:
            return None
        return self._group.layer_hook(clock) if self._group is not None and self._group.streams_next_step \
            else clock.layer_done

    def forward_failed(self, error: str) -> None:
        """Every stream of the failed step aborts (the worker then aborts their requests in the engine)."""
        if self._clock is not None:
            self._clock.step_failed(error)
        if self._group is not None:
            self._group.release_all()
        self._by_lanes.clear()

    def _start(self, seq: Sequence, clock: LayerClock) -> bool:
        live = self._lives.get(seq.request_id)
        if live is None or live.cancelled or not self._slots.try_acquire(live.task.decode_address):
            return False
        peer, stream = live.task.decode_address, LayerStream(clock)
        skip = live.task.decode_cached_blocks  # the decode worker holds these: they do not travel
        blocks = seq.block_table[skip:]
        by_lanes = self._lanes is not None and self._lanes.reaches(peer)
        staged = self._group is not None and not by_lanes
        if staged and (blocks := self._group.stage(seq.request_id, blocks)) is None:
            self._slots.release_unused(peer)  # no staging room: sent whole after the step
            return False
        request = SendRequest(seq.request_id, tuple(blocks), seq.num_tokens, None, prefix_blocks=skip, stream=stream)
        try:
            handle = self._sender.send(peer, request) if not by_lanes else self._send_by_lanes(peer, request)
        except Exception:  # a bad address: the request goes whole after the step (and fails there)
            self._slots.release_unused(peer)
            if staged:
                self._group.unstage(seq.request_id)
            return False
        if by_lanes:
            self._by_lanes.add(seq.request_id)
        live.stream, live.handle = stream, handle
        live.report = dataclasses.replace(live.report, transfer_started=time.time())
        self._on_sent(seq.request_id, handle)
        return True

    def _send_by_lanes(self, peer: Any, request: SendRequest) -> TransferHandle:
        """A stream from every rank, on the coming step (its number: the step messages sent so far); once it is under
        way, the followers are asked to report that step's layers to their lanes. One rank: its lane streams on the
        step's clock."""
        leader = self._engine.tp_leader
        if leader is None:
            return self._lanes.send(peer, request, 0)
        handle = self._lanes.send(peer, request, leader.steps_sent)
        leader.stream_lanes_next_step()
        return handle

    def complete(self, delta: StepDelta, live: Any) -> bool:
        """After the step: hands a PREFILLED request's blocks and first token to its stream (True), or
        aborts the stream when the first token ended the request (False: the engine freed the blocks;
        the caller reports it FINISHED and releases its slot). A stream whose transfer already ended (it
        failed) gets nothing: the blocks are freed here and the transfer's end reports the failure."""
        stream: LayerStream = live.stream
        live.report = dataclasses.replace(live.report, forward_ended=stream.clock.last_layer_at)
        staged = self._group is not None and delta.request_id not in self._by_lanes
        self._by_lanes.discard(delta.request_id)
        if delta.kv_block_ids is None:
            stream.abort("the first token ended the request")
            if staged:
                self._group.release(delta.request_id)
            return False
        request = take_prefilled(self._engine, delta.request_id, live.report.first_logprobs,
                                 live.task.decode_cached_blocks)  # the skipped blocks go back to the engine
        blocks, free = request.block_ids, self._engine.free_blocks
        if staged:  # the KV is in the staging blocks: those travel, the engine's go back
            blocks, free = self._group.hand_over(delta.request_id, request.block_ids), self._group.staging.free
        if not stream.finish(StreamTail(request.first_token, request.first_logprobs), blocks):
            free(blocks)
        return True

    def unfinished(self, live: Any) -> bool:
        """Whether `live` streams from a step that never completed (its sequence is still in the engine)."""
        return live.stream is not None and self._engine.get_sequence(live.task.request_id) is not None
