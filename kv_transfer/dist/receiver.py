"""TorchDistReceiver: the receiving end of the gloo / nccl transports (and, with its own link, of ipc).

One ControlListener, bound to the node address the receiver is given, takes the senders' connections;
each authenticated connection from a sender rank this receiver listens to is served on its own thread by
a ReceiverLink, which builds each epoch's data-plane group when the sender asks (CONNECT) and serves the
sender's transfers one by one (TRANSFER -> bytes -> STATUS).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from kv_transfer.config import DistRendezvous, ReceiverAddress, TransferConfig
from kv_transfer.connector import KVReceiver
from kv_transfer.control.connection import ControlClosed, ControlConnection, Kind
from kv_transfer.control.exchange import MAX_TRANSFER_FRAME_BYTES, TransferFrame
from kv_transfer.control.handshake import PeerHello
from kv_transfer.control.listener import ControlListener
from kv_transfer.dist.channel import RECEIVER, PairChannel
from kv_transfer.dist.inline import receive_inline
from kv_transfer.dist.protocol import receive_transfer
from kv_transfer.dist.sender import staging_device
from kv_transfer.pool import KVPoolView
from kv_transfer.results import ReceiveInbox
from kv_transfer.staging import StagingPool
from kv_transfer.status import KVTransferError, TransferStatus

log = logging.getLogger(__name__)
RECEIVER_FRAMES = (Kind.CONNECT, Kind.TRANSFER, Kind.CANCEL)


class ReceiverLink:
    """The receiving end of one connection (one lane of one sender): frames until the connection ends."""

    def __init__(self, owner: "TorchDistReceiver", hello: PeerHello, conn: ControlConnection):
        self.owner, self.hello, self.conn = owner, hello, conn
        self.peer_rank = hello.rank
        self.thread = threading.current_thread()  # the listener's thread for this connection
        self.channel: PairChannel | None = None  # this epoch's data-plane group

    def run(self) -> None:
        """Serves CONNECT and TRANSFER frames until the connection closes (the sender left, remove_peer,
        close) or breaks the protocol; then closes what it holds."""
        lander = ThreadPoolExecutor(1, thread_name_prefix=f"kv-land-{self.hello.rank}.{self.hello.lane}")
        try:
            self.serve(lander)
        except ControlClosed:
            pass
        except KVTransferError as exc:
            log.warning("kv link from rank %d lane %d ended: %s", self.hello.rank, self.hello.lane, exc)
        finally:
            if self.channel is not None:
                self.channel.close()
            lander.shutdown(wait=True)

    def serve(self, lander: ThreadPoolExecutor) -> None:
        owner = self.owner
        while True:
            kind, payload = self.conn.receive(MAX_TRANSFER_FRAME_BYTES, None, RECEIVER_FRAMES,
                                              owner.config.kv_transfer_timeout_s)
            if kind == Kind.CANCEL:  # for a transfer already answered: too late
                continue
            if kind == Kind.CONNECT:
                self.channel = self._connect(payload)
                continue
            frame = TransferFrame.decode(payload)
            if frame.inline_nbytes:
                receive_inline(self.conn, self.channel, frame, owner.pool, owner.staging, owner.inbox,
                               time.monotonic() + owner.config.kv_transfer_timeout_s, lander,
                               owner.config.inline_max_bytes)
            else:
                receive_transfer(self.conn, self.channel, frame, owner.pool, owner.staging, owner.inbox,
                                 owner.config.kv_transfer_timeout_s, lander)

    def _connect(self, epoch: object) -> PairChannel:
        """The group of the epoch the sender asked for (a broken one if it could not connect: the next
        transfer is then declined and the sender asks again)."""
        if self.channel is not None:
            self.channel.close()
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise KVTransferError(TransferStatus.MALFORMED, "bad CONNECT frame")
        owner = self.owner
        channel = PairChannel(owner.backend, RECEIVER, staging_device(owner.backend, owner.pool),
                              owner.config.connect_timeout_s, owner.config.kv_transfer_timeout_s, epoch,
                              f"kv link {self.hello.rank}->{owner.rendezvous.rank}.{self.hello.lane}")
        try:
            channel.connect(self.conn)
        except KVTransferError as exc:
            log.warning("kv link from rank %d: %s", self.hello.rank, exc)
        return channel


class TorchDistReceiver(KVReceiver):
    """KVReceiver over torch.distributed; serves the given sender ranks (add_peer / remove_peer change them
    while it runs) on a ControlListener bound to `host` (a free port; `address.target` says which)."""

    link_class = ReceiverLink

    @property
    def lanes(self) -> int:
        """Connections per sender (TransferConfig.dist_lanes; both ends must agree)."""
        return self.config.dist_lanes

    def __init__(self, config: TransferConfig, pool: KVPoolView, rendezvous: DistRendezvous,
                 peers: Sequence[int], backend: str = "gloo", host: str = "127.0.0.1"):
        self.config, self.pool, self.rendezvous, self.backend = config, pool, rendezvous, backend
        self.inbox = ReceiveInbox(config.cancel_ttl_s)
        self.staging = StagingPool(staging_device(backend, pool), pin_memory=pool.device.type == "cuda",
                                   max_cached_bytes=config.staging_cache_bytes)
        self.stopping = threading.Event()
        self._peers = set(peers)
        self._links_lock = threading.Lock()
        self._links: list[ReceiverLink] = []
        self.listener = ControlListener(host, config.cluster_secret, rendezvous.namespace, self._admit, self._serve,
                                        handshake_timeout_s=min(10.0, config.connect_timeout_s))

    @property
    def address(self) -> ReceiverAddress:
        return ReceiverAddress(self.backend, rank=self.rendezvous.rank, target=self.listener.target)

    @property
    def dropped_connections(self) -> dict[str, int]:
        """Connections refused before anything was read from them, by reason (unauthenticated, garbage, ...)."""
        return dict(self.listener.drops)

    def _admit(self, hello: PeerHello) -> bool:
        with self._links_lock:
            return not self.stopping.is_set() and hello.rank in self._peers and 0 <= hello.lane < self.lanes

    def _serve(self, hello: PeerHello, conn: ControlConnection) -> None:
        link = self.link_class(self, hello, conn)
        with self._links_lock:
            if self.stopping.is_set() or hello.rank not in self._peers:
                return
            self._links.append(link)
        try:
            link.run()
        finally:
            with self._links_lock:
                if link in self._links:
                    self._links.remove(link)

    def add_peer(self, rank: int) -> None:
        """Serves sender `rank` too (no-op if it already does, or once closed)."""
        with self._links_lock:
            if not self.stopping.is_set():
                self._peers.add(rank)

    def remove_peer(self, rank: int) -> None:
        """Stops serving sender `rank`: its connections are closed (their threads end) and new ones refused."""
        with self._links_lock:
            self._peers.discard(rank)
            gone = [link for link in self._links if link.peer_rank == rank]
        for link in gone:
            link.conn.close()

    def close(self) -> None:
        """Stops accepting, closes every connection and waits for their threads (bounded)."""
        with self._links_lock:
            self.stopping.set()
            links = list(self._links)
        self.listener.close()
        for link in links:
            link.thread.join(self.config.kv_transfer_timeout_s + 5)
