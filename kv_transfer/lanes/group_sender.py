"""LaneSender: a prefill worker's KVSender over lanes. send() ships a request's KV heads from the ranks that hold them
straight to the ranks of the receiving group (peer.lanes) that hold them, in parts (kv_transfer/lanes/parts.py): between
groups of one layout rank i to rank i; otherwise each receiving rank's heads from the sending ranks that hold them,
split or merged. Rank 0's parts go from its own lane, the followers' through rank 0's hub, and the handle settles once
every part ended: OK when all of them delivered, else the first failure. A failed part does not cancel the others here
(a gRPC call cancelled early can leave its stream's writer waiting): the receiving side ends them, as it drops every
part of a request one of whose parts failed (group_receiver.py, assembly.py). handle.cancel() cancels every part. The
blocks are the engine's (rank 0's allocator): they are freed once, when the last part ended, so no lane still reads a
block the engine hands out again. A worker of one rank has a LaneSender too when its receivers have lanes of another
layout (its one lane splits its heads among their ranks).

A layer-streamed request (request.stream, the worker's LayerStream) streams from every rank: rank 0's parts from
streams on the same clock, each follower's from streams on its own forward's clock for the same step (Ship names the
step; the engine's step message asks the followers to report its layers: TPLeader.stream_lanes_next_step). The
worker's stream itself travels nowhere: its finish() / abort() is passed on to every part's stream, and its blocks
are freed (LayerStream.ended) once every part ended.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kv_transfer.config import ReceiverAddress
from kv_transfer.connector import KVSender
from kv_transfer.lanes.hub import LaneHub
from kv_transfer.lanes.messages import EndStream, Forget, ForgetPeer, Ship
from kv_transfer.lanes.parts import LanePart, plan_parts
from kv_transfer.lanes.rank_lane import LaneSpec, SendLane, lane_address
from kv_transfer.layer_stream import LayerStream, StreamTail, release_send_blocks
from kv_transfer.lanes.tally import LaneTally
from kv_transfer.results import SendRequest, SendResult, TransferHandle
from kv_transfer.status import KVTransferError, TransferStatus

JOIN_TIMEOUT_S = 120.0  # how long the followers' lanes may take to join rank 0's hub


@dataclass
class _Shipping(LaneTally):
    request: SendRequest
    handle: TransferHandle
    parts: tuple[LanePart, ...]
    waiting: set[int]  # parts not ended yet
    started: float = field(default_factory=time.monotonic)
    failure: tuple[TransferStatus, str] | None = None


class LaneSender(KVSender):
    """The KVSender of a prefill engine's rank 0 (of a tensor-parallel engine whose followers run `spec` as their rank
    service, build_engine(tp_rank_service=spec), or of a one-rank engine); hub is the one spec names, owned by this
    sender from now on (closed by close())."""

    def __init__(self, engine: Any, hub: LaneHub, spec: LaneSpec, join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        if spec.role != "send":
            raise ValueError("LaneSender is for a prefill engine's rank 0 and a 'send' LaneSpec")
        self.size, self.hub = 1 if engine.tp_leader is None else engine.tp_leader.group.size, hub
        hub.wait_followers(range(1, self.size), join_timeout_s)
        kv = engine.kv_cache.kv  # [L, 2, N, bs, H_rank, D]
        self.lane = SendLane(spec, kv, engine.kv_cache.head_range)
        self.heads = (tuple(engine.kv_cache.head_range),) + tuple(hub.heads[rank] for rank in range(1, self.size))
        self._free, self._head_block_nbytes = engine.free_blocks, kv[:, :, 0].nbytes // kv.shape[4]
        self._shipping: dict[str, _Shipping] = {}
        self._lock = threading.Lock()
        self.delivered = 0  # transfers every part delivered
        hub.on_ended = lambda ended: self._part_ended(ended.part, ended.request_id, ended.status, ended.message,
                                                      ended.rank)
        hub.on_lost = self._lost

    def plan(self, peer: ReceiverAddress) -> tuple[LanePart, ...]:
        """The parts a transfer to peer travels in (ValueError when peer's lanes cannot take them)."""
        if not peer.lanes or len(peer.lane_heads) != len(peer.lanes):
            raise ValueError(f"{peer.target} has no KV lanes")
        return plan_parts(self.heads, peer.lane_heads)

    def reaches(self, peer: ReceiverAddress) -> bool:
        """Whether a transfer to peer goes by lanes: it has them, and this group or it has more than one rank."""
        if not peer.lanes or (self.size == 1 and len(peer.lanes) == 1):
            return False
        try:
            self.plan(peer)
        except ValueError:
            return False
        return True

    def forget_peer(self, peer: ReceiverAddress) -> None:
        """Every rank's lane closes what it keeps for the receiving group at peer."""
        for rank in range(len(peer.lanes)):
            self.lane.forget_peer(lane_address(peer, rank))
            for follower in range(1, self.size):
                self.hub.send(follower, ForgetPeer(lane_address(peer, rank)))

    def send(self, peer: ReceiverAddress, request: SendRequest, stream_step: int | None = None) -> TransferHandle:
        """As KVSender.send, to a receiver with lanes (reaches). A layer-streamed request names the number of the
        step whose forward writes its KV (stream_step). ValueError, before the blocks are taken, for a peer without
        lanes, a streamed request without its step or a request id already in flight."""
        parts = self.plan(peer)
        if (request.stream is None) != (stream_step is None):
            raise ValueError("a layer-streamed request travels by lanes with its step number (and only it)")
        handle = TransferHandle(request.request_id)
        with self._lock:
            if request.request_id in self._shipping:
                raise ValueError(f"request {request.request_id!r} is already being shipped")
            self._shipping[request.request_id] = _Shipping(request, handle, parts, set(range(len(parts))))
        unstreamed = dataclasses.replace(request, stream=None)
        for index, part in enumerate(parts):
            command = Ship(unstreamed, lane_address(peer, part.receiver), part.heads, index, stream_step)
            if part.sender and not self.hub.send(part.sender, command):
                self._part_ended(index, request.request_id, TransferStatus.PEER_FAILED,
                                 f"rank {part.sender}'s lane is gone", part.sender)
        own = [index for index, part in enumerate(parts) if part.sender == 0]
        requests = [unstreamed] * len(own) if request.stream is None else self._own_streams(request, parts, len(own))
        for index, own_request in zip(own, requests):
            self.lane.ship(lane_address(peer, parts[index].receiver), own_request,
                           lambda rid, status, message, index=index: self._part_ended(index, rid, status, message),
                           parts[index].heads, index)
        handle.on_cancel(lambda: self._cancel(request.request_id))
        return handle

    def _own_streams(self, request: SendRequest, parts: tuple[LanePart, ...], count: int) -> list[SendRequest]:
        """Rank 0's parts of a streamed request: streams on the worker's clock, finished or aborted with it, as the
        followers' streams are (EndStream)."""
        own = [LayerStream(request.stream.clock) for _ in range(count)]
        followers = sorted({part.sender for part in parts} - {0})

        def end(tail: StreamTail | None, reason: str | None) -> None:
            for stream in own:
                if tail is not None:
                    stream.finish(tail, request.block_ids)  # the lane frees nothing: the blocks go when all ended
                else:
                    stream.abort(reason)
            for rank in followers:
                self.hub.send(rank, EndStream(request.request_id, tail, reason or ""))

        request.stream.add_listener(end)
        return [dataclasses.replace(request, stream=stream) for stream in own]

    def _part_ended(self, index: int, request_id: str, status: TransferStatus, message: str,
                    rank: int = 0) -> None:
        """Part `index` of request_id ended (reported by `rank`); the last one frees the blocks and settles the
        handle."""
        with self._lock:
            shipping = self._shipping.get(request_id)
            if shipping is None or index >= len(shipping.parts) or shipping.parts[index].sender != rank:
                return
            part = shipping.parts[index]
            label = f"rank {rank}'s lane" if len(shipping.parts) == self.size else \
                f"part {index} (rank {rank} -> rank {part.receiver}, KV heads {part.heads})"
            if shipping.count_end(index, status, message, label) is None:
                return
            done = not shipping.waiting
            if done:
                del self._shipping[request_id]
        if done:
            self._settle(shipping)

    def _settle(self, shipping: _Shipping) -> None:
        request = shipping.request
        release_send_blocks(request, self._free)  # a streamed one's only if the worker's stream handed them over
        if shipping.failure is not None:
            shipping.handle.settle(KVTransferError(*shipping.failure, request.request_id))
        else:
            self.delivered += 1
            heads = sum(part.num_heads for part in shipping.parts)
            nbytes = len(request.block_ids) * self._head_block_nbytes * heads
            shipping.handle.settle(SendResult(request.request_id, nbytes, time.monotonic() - shipping.started))

    def _cancel(self, request_id: str) -> None:
        """Cancels every part of request_id still under way (each ends CANCELLED, freeing both sides)."""
        with self._lock:
            shipping = self._shipping.get(request_id)
            ranks = set() if shipping is None else {shipping.parts[index].sender for index in shipping.waiting}
        for rank in ranks - {0}:
            self.hub.send(rank, Forget(request_id))
        if 0 in ranks:
            self.lane.cancel(request_id)

    def _lost(self, rank: int) -> None:
        """A follower's link ended: its parts under way will not report; they ended as PEER_FAILED."""
        with self._lock:
            lost = [(rid, index) for rid, shipping in self._shipping.items() for index in shipping.waiting
                    if shipping.parts[index].sender == rank]
        for request_id, index in lost:
            self._part_ended(index, request_id, TransferStatus.PEER_FAILED, f"rank {rank} is gone", rank)

    def close(self) -> None:
        """Ends rank 0's lane (its queued transfers fail) and the hub; whatever is still shipping fails (CANCELLED)
        and its blocks are freed."""
        self.lane.close()
        self.hub.close()
        with self._lock:
            left = list(self._shipping.values())
            self._shipping.clear()
        for shipping in left:
            shipping.failure = shipping.failure or (TransferStatus.CANCELLED, "the sender closed")
            self._settle(shipping)
