"""IpcSender / IpcReceiver: the rank transports' links and threads, with the ipc message order.

Each (sender rank, receiver rank) pair is one authenticated control connection, as for gloo/nccl, with
one lane (a pair's transfers in order; each connection maps the sender's pool once) and no process group:
only manifests, the pool handle and statuses cross it; the KV is copied by the receiver straight out of
the sender's pool.
"""
from __future__ import annotations

import logging
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from kv_transfer.config import DistRendezvous, ReceiverAddress, TransferConfig
from kv_transfer.control.connection import ControlConnection, Kind
from kv_transfer.control.exchange import MAX_TRANSFER_FRAME_BYTES, Declined, TransferFrame, cancel_transfer
from kv_transfer.control.handshake import PeerHello
from kv_transfer.dist.receiver import ReceiverLink, TorchDistReceiver
from kv_transfer.dist.sender import SenderLink, TorchDistSender, open_control
from kv_transfer.ipc.landing import NO_STAGING
from kv_transfer.ipc.pool_handle import check_exportable, export_pool
from kv_transfer.ipc.protocol import PeerPool, receive_ipc, send_ipc
from kv_transfer.outgoing import prepare_outgoing
from kv_transfer.outgoing import OutgoingTransfer
from kv_transfer.pool import KVPoolView
from kv_transfer.results import SendRequest, TransferHandle
from kv_transfer.status import TransferStatus

log = logging.getLogger(__name__)
CONTROL_BACKEND = "gloo"  # the name the dist classes are built with; no process group is ever made


class _IpcSenderLink(SenderLink):
    """The sending end of one pair; sends the pool handle with each TRANSFER until one was accepted on
    the connection."""

    def __init__(self, owner: "IpcSender", peer: ReceiverAddress, lane: int, jobs: queue.SimpleQueue):
        self.published_on: ControlConnection | None = None  # the connection whose receiver mapped our pool
        super().__init__(owner, peer, lane, jobs)

    def _inline(self, outgoing: OutgoingTransfer) -> bool:
        return False  # the receiver copies out of the mapped pool: no byte travels

    def _connect(self, with_group: bool = False) -> None:  # no group: nothing but the connection
        if self.conn is None:
            hello = PeerHello(self.owner.rendezvous.namespace, self.owner.rendezvous.rank, self.lane)
            self.conn, self.seq = open_control(self.peer, self.owner.config, hello), 0

    def _exchange(self, outgoing: OutgoingTransfer, handle: TransferHandle, seq: int, deadline: float) -> None:
        if handle.cancel_requested.is_set():  # the TRANSFER frame is the go-ahead: not once cancelled
            raise Declined(TransferStatus.CANCELLED, "cancelled by the sender", outgoing.manifest.request_id)
        pool_handle = export_pool(self.owner.pool.kv) if self.published_on is not self.conn else None
        conn = self.conn
        handle.on_cancel(lambda: cancel_transfer(conn, seq))  # the receiver drops it unless delivered
        send_ipc(conn, outgoing, seq, pool_handle, deadline)
        self.published_on = self.conn


class IpcSender(TorchDistSender):
    """KVSender for transport 'ipc': receivers on the same host and device copy the KV out of this pool.

    The pool must be a CUDA tensor, or a CPU tensor in shared memory (ValueError otherwise). As for every
    transport, send() hands request.block_ids to the transfer, which frees them exactly once, after the
    receiver's final ack (so its copies have finished reading them) or on any failure, then resolves the
    handle. On CUDA the blocks must have been written on the caller's current stream: the manifest's
    checksums wait for an event recorded there, so the KV is complete before the receiver learns of it.
    The receiver keeps a mapping of the whole pool while the pair's connection lives; it only reads the
    blocks of transfers under way."""

    def __init__(self, config: TransferConfig, pool: KVPoolView, rendezvous: DistRendezvous):
        check_exportable(pool.kv)
        super().__init__(config, pool, rendezvous, backend=CONTROL_BACKEND)
        self.staging = NO_STAGING  # nothing is gathered: the manifest is built, the pool is never staged

    def send(self, peer: ReceiverAddress, request: SendRequest) -> TransferHandle:
        if request.stream is not None:  # the receiver copies whole runs once the manifest's checksums hold
            raise ValueError("transport 'ipc' does not stream layer by layer: use kv streaming 'request'")
        return super().send(peer, request)

    @property
    def lanes(self) -> int:
        return 1  # one connection (and one mapping of this pool) per receiver

    def prepare(self, request: SendRequest, ready) -> OutgoingTransfer:
        """The manifest alone: one run per stretch of consecutive blocks, however long (nothing is pipelined:
        the receiver copies all runs at once), and no checksums (the copy stays on one device). On CUDA the
        link thread waits for the ready event here, so the KV is complete before the TRANSFER frame leaves."""
        if ready is not None:
            ready.synchronize()
        return prepare_outgoing(self.pool, request, self.staging, ready, max_run_bytes=0, trailing_checksums=True,
                                all_direct=True)

    def _new_link(self, peer: ReceiverAddress, lane: int, jobs: queue.SimpleQueue) -> SenderLink:
        return _IpcSenderLink(self, peer, lane, jobs)


class _IpcReceiverLink(ReceiverLink):
    """The receiving end of one pair: the sender's pool is mapped once per connection."""

    def serve(self, lander: ThreadPoolExecutor) -> None:
        owner, peer = self.owner, PeerPool(self.owner.pool.device)
        try:
            while True:
                kind, payload = self.conn.receive(MAX_TRANSFER_FRAME_BYTES, None, (Kind.TRANSFER, Kind.CANCEL),
                                                  owner.config.kv_transfer_timeout_s)
                if kind == Kind.CANCEL:  # for a transfer already answered: too late
                    continue
                receive_ipc(self.conn, TransferFrame.decode(payload), peer, owner.pool, owner.inbox,
                            owner.config.kv_transfer_timeout_s, lander)
        finally:
            peer.kv = None  # unmapped here, not whenever the frame is collected: the sender may exit next


class IpcReceiver(TorchDistReceiver):
    """KVReceiver for transport 'ipc', serving the given sender ranks.

    Per transfer it allocates its blocks when it accepts the manifest, copies each run out of the sender's
    mapped pool into them (one copy per run, on a side stream on CUDA), verifies the run's checksum and
    waits for the copies to complete before its reply. The blocks belong to the transfer until a
    ReceivedKV hands them to the caller, and are freed by the transfer on any failure, cancel or timeout
    (after any copy under way has finished). The pool may be any CUDA or CPU pool; a sender's pool must be
    on the same device."""

    link_class = _IpcReceiverLink

    @property
    def lanes(self) -> int:
        return 1  # as IpcSender

    def __init__(self, config: TransferConfig, pool: KVPoolView, rendezvous: DistRendezvous, peers: Sequence[int],
                 host: str = "127.0.0.1"):
        super().__init__(config, pool, rendezvous, peers, backend=CONTROL_BACKEND, host=host)
        self.staging = NO_STAGING

    @property
    def address(self) -> ReceiverAddress:
        return ReceiverAddress("ipc", rank=self.rendezvous.rank, target=self.listener.target)
