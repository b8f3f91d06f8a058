"""LaneSender: a tensor-parallel prefill group's KVSender over lanes. send() ships each rank's heads of the request's
blocks from that rank to the same rank of the receiving group (peer.lanes), rank 0's lane here and the followers'
through rank 0's hub, and the handle settles once every rank's lane ended: OK when all of them delivered, else the
first failure. A failed lane does not cancel the others here (a gRPC call cancelled early can leave its stream's
writer waiting): the receiving group ends them, as it drops every lane of a request one of whose lanes failed
(group_receiver.py). handle.cancel() cancels every lane. The blocks are the engine's (rank 0's allocator): they are
freed once, when the last lane ended, so no lane still reads a block the engine hands out again.

A layer-streamed request (request.stream, the worker's LayerStream) streams from every rank: rank 0's lane from a
stream on the same clock, each follower's from a stream on its own forward's clock for the same step (Ship names the
step; the engine's step message asks the followers to report its layers: TPLeader.stream_lanes_next_step). The
worker's stream itself travels nowhere: its finish() / abort() is passed on to every rank's stream, and its blocks
are freed (LayerStream.ended) once every lane ended.
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
from kv_transfer.layer_stream import LayerStream, StreamTail, release_send_blocks
from kv_transfer.lanes.rank_lane import LaneSpec, SendLane, lane_address
from kv_transfer.lanes.tally import LaneTally
from kv_transfer.results import SendRequest, SendResult, TransferHandle
from kv_transfer.status import KVTransferError, TransferStatus

JOIN_TIMEOUT_S = 120.0  # how long the followers' lanes may take to join rank 0's hub


@dataclass
class _Shipping(LaneTally):
    request: SendRequest
    handle: TransferHandle
    waiting: set[int]  # ranks whose lane has not ended yet
    started: float = field(default_factory=time.monotonic)
    failure: tuple[TransferStatus, str] | None = None


class LaneSender(KVSender):
    """The KVSender of a tensor-parallel engine's rank 0 (engine.tp_leader set) whose followers run `spec` as their
    rank service (build_engine(tp_rank_service=spec)); hub is the one spec names, owned by this sender from now on
    (closed by close())."""

    def __init__(self, engine: Any, hub: LaneHub, spec: LaneSpec, join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        if engine.tp_leader is None or spec.role != "send":
            raise ValueError("LaneSender is for a tensor-parallel prefill engine's rank 0 and a 'send' LaneSpec")
        self.size, self.hub = engine.tp_leader.group.size, hub
        hub.wait_followers(range(1, self.size), join_timeout_s)
        self.lane = SendLane(spec, engine.kv_cache.kv, engine.kv_cache.head_range)
        self._free, self._block_nbytes = engine.free_blocks, engine.kv_cache.kv[:, :, 0].nbytes
        self._shipping: dict[str, _Shipping] = {}
        self._lock = threading.Lock()
        self.delivered = 0  # transfers every rank's lane delivered
        hub.on_ended = lambda ended: self._lane_ended(ended.rank, ended.request_id, ended.status, ended.message)
        hub.on_lost = self._lost

    def reaches(self, peer: ReceiverAddress) -> bool:
        """Whether peer is a receiving group of this group's size (its lanes take each rank's heads)."""
        return len(peer.lanes) == self.size

    def forget_peer(self, peer: ReceiverAddress) -> None:
        """Every rank's lane closes what it keeps for the receiving group at peer."""
        if not self.reaches(peer):
            return
        self.lane.sender.forget_peer(lane_address(peer, 0))
        for rank in range(1, self.size):
            self.hub.send(rank, ForgetPeer(lane_address(peer, rank)))

    def send(self, peer: ReceiverAddress, request: SendRequest, stream_step: int | None = None) -> TransferHandle:
        """As KVSender.send, to a receiving group of the same size (len(peer.lanes) ranks). A layer-streamed request
        names the number of the step whose forward writes its KV (stream_step). ValueError, before the blocks are
        taken, for a peer of another size, a streamed request without its step or a request id already in flight."""
        if not self.reaches(peer):
            raise ValueError(f"a lane transfer needs a receiver of {self.size} ranks; {peer.target} has "
                             f"{len(peer.lanes) or 1}")
        if (request.stream is None) != (stream_step is None):
            raise ValueError("a layer-streamed request travels by lanes with its step number (and only it)")
        handle = TransferHandle(request.request_id)
        with self._lock:
            if request.request_id in self._shipping:
                raise ValueError(f"request {request.request_id!r} is already being shipped")
            self._shipping[request.request_id] = _Shipping(request, handle, set(range(self.size)))
        unstreamed = dataclasses.replace(request, stream=None)
        for rank in range(1, self.size):
            if not self.hub.send(rank, Ship(unstreamed, lane_address(peer, rank), stream_step)):
                self._lane_ended(rank, request.request_id, TransferStatus.PEER_FAILED, f"rank {rank}'s lane is gone")
        own = unstreamed if request.stream is None else self._own_stream(request)
        self.lane.ship(lane_address(peer, 0), own, lambda rid, status, message: self._lane_ended(0, rid, status,
                                                                                                 message))
        handle.on_cancel(lambda: self._cancel(request.request_id))
        return handle

    def _own_stream(self, request: SendRequest) -> SendRequest:
        """Rank 0's lane of a streamed request: a stream on the worker's clock, finished or aborted with it, as the
        followers' streams are (EndStream)."""
        own = LayerStream(request.stream.clock)

        def end(tail: StreamTail | None, reason: str | None) -> None:
            if tail is not None:
                own.finish(tail, request.block_ids)  # the lane frees nothing: the blocks go when every lane ended
            else:
                own.abort(reason)
            for rank in range(1, self.size):
                self.hub.send(rank, EndStream(request.request_id, tail, reason or ""))

        request.stream.add_listener(end)
        return dataclasses.replace(request, stream=own)

    def _lane_ended(self, rank: int, request_id: str, status: TransferStatus, message: str) -> None:
        """One rank's lane of request_id ended; the last one frees the blocks and settles the handle."""
        with self._lock:
            shipping = self._shipping.get(request_id)
            if shipping is None or shipping.count_end(rank, status, message) is None:
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
            nbytes = len(request.block_ids) * self._block_nbytes * self.size
            shipping.handle.settle(SendResult(request.request_id, nbytes, time.monotonic() - shipping.started))

    def _cancel(self, request_id: str) -> None:
        """Cancels every lane of request_id still under way (each ends CANCELLED, freeing both sides)."""
        with self._lock:
            shipping = self._shipping.get(request_id)
            waiting = set() if shipping is None else set(shipping.waiting)
        for rank in waiting - {0}:
            self.hub.send(rank, Forget(request_id))
        if 0 in waiting:
            self.lane.cancel(request_id)

    def _lost(self, rank: int) -> None:
        """A follower's link ended: its lanes under way will not report; they ended as PEER_FAILED."""
        with self._lock:
            waiting = [rid for rid, shipping in self._shipping.items() if rank in shipping.waiting]
        for request_id in waiting:
            self._lane_ended(rank, request_id, TransferStatus.PEER_FAILED, f"rank {rank} is gone")

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
