"""The sending end of the torch.distributed transports (gloo on CPU, nccl on CUDA): TransferConfig.dist_lanes links per
peer, each one authenticated control connection (kv_transfer/control/) with a thread at both ends, and over it the
data plane's process group (one epoch at a time).

Transfers to the same peer start in submission order, up to dist_lanes at once (each lane takes the next
queued transfer when its last one ended); transfers to different peers run in parallel. A lane whose group
breaks (peer death, timeout, a transfer given up half-read) opens its next epoch's group with its next
transfer (a CONNECT frame); a lane whose connection fails connects and authenticates afresh.
The receiver listens on one ControlListener, bound to its node address: every connection proves the
cluster secret before anything else is read, and comes from a sender rank it listens to.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time

import torch

from kv_transfer.config import DistRendezvous, ReceiverAddress, TransferConfig
from kv_transfer.connector import KVSender
from kv_transfer.control.connection import ControlConnection, Kind
from kv_transfer.control.exchange import Declined, cancel_transfer
from kv_transfer.control.handshake import PeerHello, client_handshake
from kv_transfer.device_sync import record_ready_event
from kv_transfer.dist.channel import SENDER, PairChannel
from kv_transfer.dist.inline import send_inline, travels_inline
from kv_transfer.dist.protocol import send_transfer
from kv_transfer.layer_stream import release_send_blocks
from kv_transfer.outgoing import OutgoingTransfer, prepare_outgoing
from kv_transfer.pool import KVPoolView
from kv_transfer.results import SendRequest, SendResult, TransferHandle
from kv_transfer.staging import StagingPool
from kv_transfer.status import KVTransferError, TransferStatus

log = logging.getLogger(__name__)


def staging_device(backend: str, pool: KVPoolView) -> torch.device:
    """nccl moves CUDA staging buffers; gloo moves host buffers (pinned when the pool is on CUDA)."""
    return pool.device if backend == "nccl" else torch.device("cpu")


def open_control(peer: ReceiverAddress, config: TransferConfig, hello: PeerHello) -> ControlConnection:
    """A new authenticated control connection to the receiver at peer.target (host:port). Raises
    KVTransferError: PEER_FAILED (unreachable), UNAUTHENTICATED (refused, or it lacks our secret), TIMEOUT."""
    host, _, port = peer.target.rpartition(":")
    deadline = time.monotonic() + config.connect_timeout_s
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=config.connect_timeout_s)
    except (OSError, ValueError) as exc:
        raise KVTransferError(TransferStatus.PEER_FAILED, f"KV receiver {peer.target} unreachable: {exc}") from None
    conn = ControlConnection(sock)
    try:
        client_handshake(conn, config.cluster_secret, hello, deadline)
    except BaseException:
        conn.close()
        raise
    return conn


class SenderLink:
    """The sending end of one lane to one receiver: takes transfers from the peer's queue (shared by its
    lanes) one at a time, on its own thread, connection and channel."""

    def __init__(self, owner: "TorchDistSender", peer: ReceiverAddress, lane: int, jobs: queue.SimpleQueue):
        self.owner, self.peer, self.lane, self.jobs = owner, peer, lane, jobs
        self.conn: ControlConnection | None = None
        self.channel: PairChannel | None = None
        self.epoch, self.seq = -1, 0
        self.thread = threading.Thread(target=self._run, name=f"kv-send-{peer.rank}.{lane}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            request, handle, ready = job
            self._transfer(request, handle, ready)
        self._disconnect()

    def _transfer(self, request: SendRequest, handle: TransferHandle, ready) -> None:
        owner, started = self.owner, time.monotonic()
        try:
            if handle.cancel_requested.is_set() or owner.closed:
                raise KVTransferError(TransferStatus.CANCELLED, "cancelled before it started", request.request_id)
            outgoing = owner.prepare(request, ready)
            try:
                self._ship(outgoing, handle)
            finally:
                owner.staging.release(outgoing.staging)
            result = SendResult(request.request_id, outgoing.manifest.total_nbytes, time.monotonic() - started)
        except KVTransferError as exc:
            result = exc
        except Exception as exc:  # a bug or a bad request must still free the blocks and fail the handle
            log.exception("kv send %s failed", request.request_id)
            result = KVTransferError(TransferStatus.INTERNAL, f"{type(exc).__name__}: {exc}", request.request_id)
        release_send_blocks(request, owner.pool.free)
        handle.settle(result)

    def _ship(self, outgoing: OutgoingTransfer, handle: TransferHandle) -> None:
        """One transfer on this lane's connection. A failure the receiver reported (Declined) keeps the
        connection; any other drops it (its state is unknown), and the next transfer connects afresh."""
        try:
            self._connect(with_group=not self._inline(outgoing))
            seq, self.seq = self.seq, self.seq + 1
            deadline = time.monotonic() + self.owner.config.kv_transfer_timeout_s
            self._exchange(outgoing, handle, seq, deadline)
        except Declined:
            raise
        except KVTransferError as exc:
            self._disconnect()
            raise KVTransferError(exc.status, exc.message, outgoing.manifest.request_id) from None

    def _inline(self, outgoing: OutgoingTransfer) -> bool:
        return self.owner.travels_inline(outgoing.manifest.total_nbytes)

    def _exchange(self, outgoing: OutgoingTransfer, handle: TransferHandle, seq: int, deadline: float) -> None:
        conn = self.conn

        def cancel_after_the_bytes() -> None:  # a CANCEL frame: the receiver drops the transfer unless delivered
            handle.on_cancel(lambda: cancel_transfer(conn, seq))

        if self._inline(outgoing):
            send_inline(conn, self.channel, outgoing, seq, deadline, handle.cancel_requested, cancel_after_the_bytes)
        else:
            cancel_after_the_bytes()
            send_transfer(conn, self.channel, outgoing, seq, deadline, handle.cancel_requested)

    def _connect(self, with_group: bool = True) -> None:
        """An authenticated connection, and on it (with_group) a live group of this lane's current epoch."""
        owner = self.owner
        if self.conn is None:
            hello = PeerHello(owner.rendezvous.namespace, owner.rendezvous.rank, self.lane)
            self.conn, self.channel, self.seq = open_control(self.peer, owner.config, hello), None, 0
        if not with_group or (self.channel is not None and self.channel.broken is None):
            return
        if self.channel is not None:
            log.warning("kv link to rank %d lane %d: %s; opening epoch %d", self.peer.rank, self.lane,
                        self.channel.broken, self.epoch + 1)
            self.channel.close()
        self.epoch += 1
        self.conn.send(Kind.CONNECT, self.epoch, time.monotonic() + owner.config.connect_timeout_s)
        self.channel = PairChannel(owner.backend, SENDER, staging_device(owner.backend, owner.pool),
                                   owner.config.connect_timeout_s, owner.config.kv_transfer_timeout_s, self.epoch,
                                   f"kv link {owner.rendezvous.rank}->{self.peer.rank}.{self.lane}")
        self.channel.connect(self.conn)

    def _disconnect(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.conn is not None:
            self.conn.close()
        self.conn = self.channel = None


class TorchDistSender(KVSender):
    """KVSender over torch.distributed point-to-point (backend 'gloo' or 'nccl')."""

    @property
    def lanes(self) -> int:
        """Channels per receiver (TransferConfig.dist_lanes)."""
        return self.config.dist_lanes

    def __init__(self, config: TransferConfig, pool: KVPoolView, rendezvous: DistRendezvous, backend: str = "gloo"):
        self.config, self.pool, self.rendezvous, self.backend = config, pool, rendezvous, backend
        self.staging = StagingPool(staging_device(backend, pool), pin_memory=pool.device.type == "cuda",
                                   max_cached_bytes=config.staging_cache_bytes)
        self.closed = False
        self._jobs: dict[ReceiverAddress, queue.SimpleQueue] = {}  # per peer: the queue its lanes take from
        self._links: list[SenderLink] = []
        self._lock = threading.Lock()

    def _new_link(self, peer: ReceiverAddress, lane: int, jobs: queue.SimpleQueue) -> SenderLink:
        return SenderLink(self, peer, lane, jobs)

    def travels_inline(self, nbytes: int) -> bool:
        """Whether a transfer of nbytes of KV rides its link's control connection (kv_transfer/dist/inline.py)."""
        return travels_inline(nbytes, self.backend, self.config.inline_max_bytes)

    def prepare(self, request: SendRequest, ready) -> OutgoingTransfer:
        """The transfer as it goes on the wire: runs of at most max_run_bytes, direct where planes are large
        enough, each checksummed from the pool (after the ready event on CUDA). Inline, each is checksummed as its
        bytes go, and from a host pool every run is direct (a socket takes many planes in one write). On a link
        thread."""
        inline = self.travels_inline(len(request.block_ids) * self.pool.fingerprint.block_nbytes)
        return prepare_outgoing(self.pool, request, self.staging, ready, self.config.max_run_bytes,
                                self.config.direct_min_plane_bytes, trailing_checksums=inline,
                                stream_timeout_s=self.config.kv_transfer_timeout_s,
                                all_direct=inline and self.pool.on_host)

    def send(self, peer: ReceiverAddress, request: SendRequest) -> TransferHandle:
        if not 0 <= peer.rank < self.rendezvous.world_size or peer.rank == self.rendezvous.rank:
            raise ValueError(f"bad receiver rank {peer.rank} for sender rank {self.rendezvous.rank}")
        if not peer.target:
            raise ValueError(f"receiver rank {peer.rank} has no control address (host:port)")
        handle = TransferHandle(request.request_id)
        ready = record_ready_event(self.pool)
        with self._lock:
            if not self.closed:
                if peer not in self._jobs:  # the pair's lanes start with its first transfer
                    jobs = self._jobs[peer] = queue.SimpleQueue()
                    self._links += [self._new_link(peer, lane, jobs) for lane in range(self.lanes)]
                self._jobs[peer].put((request, handle, ready))
                return handle
        release_send_blocks(request, self.pool.free)
        handle.fail(TransferStatus.CANCELLED, "sender is closed")
        return handle

    def forget_peer(self, peer: ReceiverAddress) -> None:
        """Ends the lanes to the receiver at `peer` (their threads close their connections after what is
        queued)."""
        with self._lock:
            jobs = self._jobs.pop(peer, None)
            lanes = [link for link in self._links if link.jobs is jobs]
            self._links = [link for link in self._links if link.jobs is not jobs]
        for _ in lanes:  # one stop marker per lane
            jobs.put(None)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            links = list(self._links)
        for link in links:  # one stop marker per lane
            link.jobs.put(None)
        for link in links:
            link.thread.join(self.config.kv_transfer_timeout_s + self.config.connect_timeout_s)
