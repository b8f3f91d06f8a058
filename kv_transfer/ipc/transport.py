"""IpcSender / IpcReceiver: the dist transport's pairs, threads and epochs, with the ipc message order.

Each (sender rank, receiver rank) pair is a gloo PairChannel of the cluster's TCPStore rendezvous, exactly
as for gloo/nccl but with one lane (a pair's transfers in order, one thread per peer on each side: ipc sends
whole requests, and each channel maps the sender's pool once; a new epoch's process group after a break).
Only control words, the pool handle and manifests cross it; the KV is copied by the receiver straight out of
the sender's pool, mapped once per channel.
"""
from __future__ import annotations

import logging
import queue
import time
from typing import Sequence

from kv_transfer.config import DistRendezvous, ReceiverAddress, TransferConfig
from kv_transfer.dist.channel import PairChannel
from kv_transfer.dist.transport import ReceiverLink, SenderLink, TorchDistReceiver, TorchDistSender
from kv_transfer.ipc.landing import NO_STAGING
from kv_transfer.ipc.pool_handle import check_exportable, export_pool
from kv_transfer.ipc.protocol import PeerPool, receive_transfer, send_copy, send_manifest, send_pool_handle
from kv_transfer.outgoing import OutgoingTransfer
from kv_transfer.pool import KVPoolView
from kv_transfer.results import SendRequest, TransferHandle
from kv_transfer.status import KVTransferError

log = logging.getLogger(__name__)
CONTROL_BACKEND = "gloo"  # the pair channels carry CPU control tensors only


class _IpcSenderLink(SenderLink):
    """The sending end of one pair; publishes the pool on each channel until a manifest is accepted."""

    def __init__(self, owner: "IpcSender", peer_rank: int, lane: int, jobs: queue.SimpleQueue):
        self.published_on: PairChannel | None = None  # the channel whose receiver has mapped our pool
        super().__init__(owner, peer_rank, lane, jobs)

    def _ship(self, outgoing: OutgoingTransfer, handle: TransferHandle) -> None:
        if self.channel is None or self.channel.broken is not None:
            self._next_epoch()
        channel = self.channel
        pool_handle = export_pool(self.owner.pool.kv) if self.published_on is not channel else None
        seq, self.seq = self.seq, self.seq + 1
        channel.ring(seq)
        if seq == 0:
            channel.connect()  # waits (connect_timeout_s) for the receiver to join this epoch
        deadline = time.monotonic() + self.owner.config.kv_transfer_timeout_s
        if pool_handle is not None:
            send_pool_handle(channel, pool_handle, deadline)
        send_manifest(channel, outgoing, deadline)  # raises KVTransferError when declined
        self.published_on = channel
        send_copy(channel, outgoing.manifest.request_id, deadline, handle.cancel_requested)


class IpcSender(TorchDistSender):
    """KVSender for transport 'ipc': receivers on the same host and device copy the KV out of this pool.

    The pool must be a CUDA tensor, or a CPU tensor in shared memory (ValueError otherwise). As for every
    transport, send() hands request.block_ids to the transfer, which frees them exactly once, after the
    receiver's final ack (so its copies have finished reading them) or on any failure, then resolves the
    handle. On CUDA the blocks must have been written on the caller's current stream: the manifest's
    checksums wait for an event recorded there, so the KV is complete before the receiver learns of it.
    The receiver keeps a mapping of the whole pool while the pair's channel lives; it only reads the
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
        return 1  # one channel (and one mapping of this pool) per receiver

    def _new_link(self, peer_rank: int, lane: int, jobs: queue.SimpleQueue) -> SenderLink:
        return _IpcSenderLink(self, peer_rank, lane, jobs)


class _IpcReceiverLink(ReceiverLink):
    """The receiving end of one pair: the sender's pool is mapped afresh on each epoch's channel."""

    def _serve_epoch(self) -> bool:
        """Transfers on this epoch's channel until it breaks (True: open the next) or the receiver stops.
        The mapping of the sender's pool lives as long as the channel."""
        owner, seq, peer = self.owner, 0, PeerPool(self.owner.pool.device)
        try:
            while self.channel.wait_bell(seq, self.stopped):
                if seq == 0:
                    self.channel.connect()
                receive_transfer(self.channel, peer, owner.pool, owner.inbox, owner.config.kv_transfer_timeout_s,
                                 self.lander)
                seq += 1
            return False
        except KVTransferError as exc:
            log.warning("kv ipc link from rank %d broke: %s; waiting on its next epoch", self.peer_rank, exc)
            return not self.stopped()
        finally:
            peer.kv = None  # unmapped here, not whenever the frame is collected: the sender may exit next


class IpcReceiver(TorchDistReceiver):
    """KVReceiver for transport 'ipc', listening to the given sender ranks.

    Per transfer it allocates its blocks when it accepts the manifest, copies each run out of the sender's
    mapped pool into them (one copy per run, on a side stream on CUDA), verifies the run's checksum and
    waits for the copies to complete before its final ack. The blocks belong to the transfer until a
    ReceivedKV hands them to the caller, and are freed by the transfer on any failure, cancel or timeout
    (after any copy under way has finished). The pool may be any CUDA or CPU pool; a sender's pool must be
    on the same device."""

    link_class = _IpcReceiverLink

    @property
    def lanes(self) -> int:
        return 1  # as IpcSender

    def __init__(self, config: TransferConfig, pool: KVPoolView, rendezvous: DistRendezvous, peers: Sequence[int]):
        super().__init__(config, pool, rendezvous, (), backend=CONTROL_BACKEND)
        self.staging = NO_STAGING
        self._links = [_IpcReceiverLink(self, peer, 0) for peer in peers]

    @property
    def address(self) -> ReceiverAddress:
        return ReceiverAddress("ipc", rank=self.rendezvous.rank)
