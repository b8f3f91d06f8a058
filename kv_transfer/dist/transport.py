"""torch.distributed transports (gloo on CPU, nccl on CUDA): TransferConfig.dist_lanes PairChannels per peer,
each with one thread at both ends.

Transfers to the same peer start in submission order, up to dist_lanes at once (each lane takes the next
queued transfer when its last one ended); transfers to different peers run in parallel. A lane whose
channel breaks (peer death, timeout, protocol error) opens its next epoch's channel (a new process group)
with its next transfer; the receiver's end does the same.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from kv_transfer.config import DistRendezvous, ReceiverAddress, TransferConfig
from kv_transfer.connector import KVReceiver, KVSender
from kv_transfer.device_sync import record_ready_event
from kv_transfer.dist.channel import RECEIVER, SENDER, PairChannel, connect_store, pair_prefix
from kv_transfer.dist.protocol import receive_transfer, send_transfer
from kv_transfer.layer_stream import release_send_blocks
from kv_transfer.outgoing import prepare_outgoing
from kv_transfer.pool import KVPoolView
from kv_transfer.results import ReceiveInbox, SendRequest, SendResult, TransferHandle
from kv_transfer.staging import StagingPool
from kv_transfer.status import KVTransferError, TransferStatus

log = logging.getLogger(__name__)


def staging_device(backend: str, pool: KVPoolView) -> torch.device:
    """nccl moves CUDA staging buffers; gloo moves host buffers (pinned when the pool is on CUDA)."""
    return pool.device if backend == "nccl" else torch.device("cpu")


def _open_channel(backend: str, rdzv: DistRendezvous, sender: int, receiver: int, role: int,
                  device: torch.device, config: TransferConfig, epoch: int, lane: int) -> PairChannel:
    """The channel of epoch `epoch` of lane `lane` of the pair (sender, receiver), not yet connected."""
    try:
        store = connect_store(rdzv.host, rdzv.port, config.connect_timeout_s)
    except Exception as exc:  # torch raises DistNetworkError / RuntimeError
        raise KVTransferError(TransferStatus.PEER_FAILED, f"rendezvous store {rdzv.host}:{rdzv.port} unreachable: {exc}") from None
    prefix = pair_prefix(rdzv.namespace, sender, receiver, epoch, lane)
    return PairChannel(backend, store, prefix, role, device, config.connect_timeout_s, config.kv_transfer_timeout_s)


class SenderLink:
    """The sending end of one lane of one pair: takes transfers from the pair's queue (shared by its lanes)
    one at a time, on its own thread and channel."""

    def __init__(self, owner: "TorchDistSender", peer_rank: int, lane: int, jobs: queue.SimpleQueue):
        self.owner, self.peer_rank, self.lane, self.jobs = owner, peer_rank, lane, jobs
        self.channel: PairChannel | None = None
        self.epoch, self.seq = -1, 0
        self.thread = threading.Thread(target=self._run, name=f"kv-send-{peer_rank}.{lane}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            request, handle, ready = job
            self._transfer(request, handle, ready)
        if self.channel is not None:
            self.channel.close()

    def _transfer(self, request: SendRequest, handle: TransferHandle, ready) -> None:
        owner, started = self.owner, time.monotonic()
        try:
            if handle.cancel_requested.is_set() or owner.closed:
                raise KVTransferError(TransferStatus.CANCELLED, "cancelled before it started", request.request_id)
            outgoing = prepare_outgoing(owner.pool, request, owner.staging, ready, owner.config.max_run_bytes,
                                        owner.config.direct_min_plane_bytes,
                                        stream_timeout_s=owner.config.kv_transfer_timeout_s)
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

    def _ship(self, outgoing, handle: TransferHandle) -> None:
        if self.channel is None or self.channel.broken is not None:
            self._next_epoch()
        seq, self.seq = self.seq, self.seq + 1
        self.channel.ring(seq)
        if seq == 0:
            self.channel.connect()  # waits (connect_timeout_s) for the receiver to join this epoch
        deadline = time.monotonic() + self.owner.config.kv_transfer_timeout_s
        send_transfer(self.channel, outgoing, deadline, handle.cancel_requested)

    def _next_epoch(self) -> None:
        """The pair's next channel: the first one, or a new process group after the last one broke (the
        receiver moves to the same epoch when its end breaks)."""
        owner = self.owner
        if self.channel is not None:
            log.warning("kv link to rank %d lane %d: %s; opening epoch %d", self.peer_rank, self.lane,
                        self.channel.broken, self.epoch + 1)
            self.channel.close()
        self.epoch, self.seq = self.epoch + 1, 0
        self.channel = _open_channel(owner.backend, owner.rendezvous, owner.rendezvous.rank, self.peer_rank,
                                     SENDER, staging_device(owner.backend, owner.pool), owner.config, self.epoch,
                                     self.lane)


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
        self._jobs: dict[int, queue.SimpleQueue] = {}  # per peer: the queue its lanes take transfers from
        self._links: list[SenderLink] = []
        self._lock = threading.Lock()

    def _new_link(self, peer_rank: int, lane: int, jobs: queue.SimpleQueue) -> SenderLink:
        return SenderLink(self, peer_rank, lane, jobs)

    def send(self, peer: ReceiverAddress, request: SendRequest) -> TransferHandle:
        if not 0 <= peer.rank < self.rendezvous.world_size or peer.rank == self.rendezvous.rank:
            raise ValueError(f"bad receiver rank {peer.rank} for sender rank {self.rendezvous.rank}")
        handle = TransferHandle(request.request_id)
        ready = record_ready_event(self.pool.device)
        with self._lock:
            if not self.closed:
                if peer.rank not in self._jobs:  # the pair's lanes start with its first transfer
                    jobs = self._jobs[peer.rank] = queue.SimpleQueue()
                    self._links += [self._new_link(peer.rank, lane, jobs) for lane in range(self.lanes)]
                self._jobs[peer.rank].put((request, handle, ready))
                return handle
        release_send_blocks(request, self.pool.free)
        handle.fail(TransferStatus.CANCELLED, "sender is closed")
        return handle

    def forget_peer(self, peer: ReceiverAddress) -> None:
        """Ends the lanes to receiver rank peer.rank (their threads close their channels after what is queued)."""
        with self._lock:
            jobs = self._jobs.pop(peer.rank, None)
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


class ReceiverLink:
    """The receiving end of one lane of one pair: sleeps on the doorbell, then serves transfers one by one."""

    def __init__(self, owner: "TorchDistReceiver", peer_rank: int, lane: int = 0):
        self.owner, self.peer_rank, self.lane = owner, peer_rank, lane
        self.retired = threading.Event()  # remove_peer: this link alone stops
        self.channel = self._open(0)
        self.lander = ThreadPoolExecutor(1, thread_name_prefix=f"kv-land-{peer_rank}.{lane}")
        self.thread = threading.Thread(target=self._run, name=f"kv-recv-{peer_rank}.{lane}", daemon=True)
        self.thread.start()

    def _open(self, epoch: int) -> PairChannel:
        owner, rdzv = self.owner, self.owner.rendezvous
        return _open_channel(owner.backend, rdzv, self.peer_rank, rdzv.rank, RECEIVER,
                             staging_device(owner.backend, owner.pool), owner.config, epoch, self.lane)

    def _run(self) -> None:
        """Serves epoch after epoch: a broken channel (a failed or timed-out transfer, a peer that went
        away) is closed and the next epoch's is opened, as the sender does after its end broke."""
        epoch = 0
        try:
            while self._serve_epoch():
                epoch += 1
                self.channel.close()
                self.channel = self._open(epoch)
        except Exception:
            log.exception("kv link from rank %d crashed", self.peer_rank)
        finally:
            self.channel.close()
            self.lander.shutdown(wait=True)

    def stopped(self) -> bool:
        return self.owner.stopping.is_set() or self.retired.is_set()

    def _serve_epoch(self) -> bool:
        """Transfers on this epoch's channel until it breaks (True: open the next) or the receiver stops."""
        owner, seq = self.owner, 0
        try:
            while self.channel.wait_bell(seq, self.stopped):
                if seq == 0:
                    self.channel.connect()
                receive_transfer(self.channel, owner.pool, owner.staging, owner.inbox,
                                 owner.config.kv_transfer_timeout_s, self.lander)
                seq += 1
            return False
        except KVTransferError as exc:
            log.warning("kv link from rank %d broke: %s; waiting on its next epoch", self.peer_rank, exc)
            return not self.stopped()


class TorchDistReceiver(KVReceiver):
    """KVReceiver over torch.distributed; listens to the given sender ranks (add_peer / remove_peer change
    them while it runs)."""

    link_class = ReceiverLink

    @property
    def lanes(self) -> int:
        """Channels per sender (TransferConfig.dist_lanes; both ends must agree)."""
        return self.config.dist_lanes

    def __init__(self, config: TransferConfig, pool: KVPoolView, rendezvous: DistRendezvous,
                 peers: Sequence[int], backend: str = "gloo"):
        self.config, self.pool, self.rendezvous, self.backend = config, pool, rendezvous, backend
        self.inbox = ReceiveInbox(config.cancel_ttl_s)
        self.staging = StagingPool(staging_device(backend, pool), pin_memory=pool.device.type == "cuda",
                                   max_cached_bytes=config.staging_cache_bytes)
        self.stopping = threading.Event()
        self._control_store = connect_store(rendezvous.host, rendezvous.port, config.connect_timeout_s)
        self._links_lock = threading.Lock()
        self._links = [self.link_class(self, peer, lane) for peer in peers for lane in range(self.lanes)]

    @property
    def address(self) -> ReceiverAddress:
        return ReceiverAddress(self.backend, rank=self.rendezvous.rank)

    def add_peer(self, rank: int) -> None:
        """Listens to sender `rank` too, from its first epoch (no-op if it already does, or once closed)."""
        with self._links_lock:
            if not self.stopping.is_set() and all(link.peer_rank != rank for link in self._links):
                self._links += [self.link_class(self, rank, lane) for lane in range(self.lanes)]

    def remove_peer(self, rank: int) -> None:
        """Retires the link from sender `rank`: its thread wakes, closes the channel and ends."""
        with self._links_lock:
            gone = [link for link in self._links if link.peer_rank == rank]
            self._links = [link for link in self._links if link.peer_rank != rank]
        for link in gone:
            link.retired.set()
            PairChannel.stop_waiting(self._control_store, link.channel.waiting_key)

    def close(self) -> None:
        self.stopping.set()
        with self._links_lock:
            links = list(self._links)
        for link in links:
            PairChannel.stop_waiting(self._control_store, link.channel.waiting_key)
        for link in links:
            link.thread.join(self.config.kv_transfer_timeout_s + 5)
