"""ControlConnection: framed, bounded messages over one TCP socket between a KV sender and a KV receiver.

A frame is a 5-byte header (payload length as big-endian uint32, kind as uint8) and a msgpack payload.
Every read has a deadline and a size bound chosen by the reader before the payload is read, so a peer can
neither stall a reader past its deadline nor make it buffer more than it allows. Counters of the frames
each way (per kind) let tests prove how many messages a transfer costs.
"""
from __future__ import annotations

import collections
import contextlib
import select
import socket
import struct
import threading
import time
from enum import IntEnum
from typing import Iterator

import msgpack

from kv_transfer.status import KVTransferError, TransferStatus

_HEADER = struct.Struct("!IB")


class Kind(IntEnum):
    """What a frame carries. Handshake kinds come first on a connection; the rest follow it."""

    HELLO = 1        # client -> listener: protocol tag and client nonce
    CHALLENGE = 2    # listener -> client: listener nonce and the listener's proof
    PROOF = 3        # client -> listener: the client's proof and who it is (rank, lane)
    WELCOME = 4      # listener -> client: accepted
    CONNECT = 10     # sender -> receiver: build data-plane process group epoch N (gloo / nccl)
    STORE_SET = 11   # both ways while a process group connects: one rendezvous key (PairStore)
    TRANSFER = 12    # sender -> receiver: one transfer's manifest and the go-ahead (and an ipc pool handle)
    CANCEL = 13      # sender -> receiver: the transfer seq is cancelled (only when cancel() came mid-way)
    STATUS = 14      # receiver -> sender: one transfer's final status


class ControlClosed(KVTransferError):
    """The connection ended (the peer closed it, or close() was called here)."""

    def __init__(self, message: str):
        super().__init__(TransferStatus.PEER_FAILED, message)


class ControlConnection:
    """One end of a control connection. Frames are sent whole from any thread (a lock keeps them apart);
    receiving is for one thread, the link's own. close() may be called from any thread and wakes a
    blocked receive."""

    def __init__(self, sock: socket.socket, peer: str = ""):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.peer = sock, peer or _peer_name(sock)
        self.sent: collections.Counter[Kind] = collections.Counter()
        self.received: collections.Counter[Kind] = collections.Counter()
        self._closed = False
        self._send_lock = threading.Lock()
        self._raw_writer: int | None = None  # the thread writing an inline transfer's raw bytes, if one is
        self._deferred: list[bytes] = []     # frames other threads sent meanwhile, written after it

    @property
    def local_host(self) -> str:
        """The local address this connection uses (the interface that reaches the peer)."""
        return self.sock.getsockname()[0]

    def send(self, kind: Kind, payload: object, deadline: float | None) -> None:
        """Sends one frame; raises ControlClosed (or KVTransferError TIMEOUT past deadline)."""
        body = msgpack.packb(payload, use_bin_type=True)
        frame = _HEADER.pack(len(body), kind) + body
        with self._send_lock:
            writer = self._raw_writer
            if writer is not None and writer != threading.get_ident():  # not between an inline transfer's bytes
                self._deferred.append(frame)
            else:
                self._io(self.sock.sendall, deadline, "send", frame)
            self.sent[kind] += 1

    @contextlib.contextmanager
    def raw_stream(self, deadline: float) -> Iterator[None]:
        """While open, this thread's send_bytes() are the only bytes on the connection: a frame another thread
        sends (a CANCEL) waits, and goes out when the stream closes."""
        with self._send_lock:
            self._raw_writer = threading.get_ident()
        try:
            yield
        finally:
            with self._send_lock:
                self._raw_writer, deferred, self._deferred = None, self._deferred, []
                for data in deferred:
                    try:
                        self._io(self.sock.sendall, deadline, "send", data)
                    except KVTransferError:  # the connection failed: the reply's read says so
                        break

    def send_bytes(self, buffers: list, deadline: float) -> None:
        """Writes raw bytes (no frame): the part of an inline transfer that follows its frame, every buffer (a
        bytes-like object) in order, in as few scatter-gather writes as the kernel takes. The caller makes sure no
        other frame may come between its pieces (only its own thread writes on the connection then)."""
        with self._send_lock:
            self._send_views(buffers, deadline)

    def _send_views(self, buffers: list, deadline: float | None) -> None:
        views = [memoryview(buffer).cast("B") for buffer in buffers]
        while views:
            sent = self._io(self.sock.sendmsg, deadline, "send", views[:_MAX_IOV])
            views = _past(views, sent)

    def read_into_all(self, views: list[memoryview], deadline: float | None) -> None:
        """Fills every flat byte view in turn with the next raw bytes of the stream, in as few scatter-gather
        reads as the kernel takes. Raises ControlClosed at the end of the stream, KVTransferError TIMEOUT past
        deadline (the stream is then out of step)."""
        views = [view for view in views if len(view)]
        while views:
            count = self._io(self.sock.recvmsg_into, deadline, "receive", views[:_MAX_IOV])[0]
            if count == 0:
                raise ControlClosed(f"control connection to {self.peer} closed")
            views = _past(views, count)

    def poll(self, max_bytes: int, kinds: tuple[Kind, ...], wait_s: float = 1.0) -> tuple[Kind, object] | None:
        """The next frame if one has begun to arrive (read within wait_s), else None without blocking."""
        if self._closed or not select.select([self.sock], [], [], 0)[0]:
            return None
        return self.receive(max_bytes, time.monotonic() + wait_s, kinds)

    def receive(self, max_bytes: int, deadline: float | None, kinds: tuple[Kind, ...] = (),
                body_timeout_s: float = 30.0) -> tuple[Kind, object]:
        """The next frame as (kind, payload). deadline None waits for ever for a frame to begin (an idle
        link), and then body_timeout_s for the rest of it (a peer cannot hold the reader mid-frame). Raises
        ControlClosed at the end of the stream, KVTransferError MALFORMED for a frame over max_bytes, of an
        unknown kind or (if given) not one of `kinds`, or whose payload is not msgpack; TIMEOUT past deadline."""
        length, kind = _HEADER.unpack(self._read(_HEADER.size, deadline))
        member = Kind._value2member_map_.get(kind)
        if member is None or (kinds and member not in kinds):
            raise KVTransferError(TransferStatus.MALFORMED, f"unexpected control frame kind {kind} from {self.peer}")
        if length > max_bytes:
            raise KVTransferError(TransferStatus.MALFORMED, f"control frame of {length} bytes from {self.peer} "
                                                            f"(at most {max_bytes})")
        raw = self._read(length, time.monotonic() + body_timeout_s if deadline is None else deadline)
        try:
            payload = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        except Exception as exc:  # noqa: BLE001 - msgpack raises several types for bad bytes
            raise KVTransferError(TransferStatus.MALFORMED, f"undecodable control frame: {exc}") from None
        self.received[member] += 1
        return member, payload

    def read_into(self, view: memoryview, deadline: float | None) -> None:
        """Fills `view` (a flat byte view) with the next len(view) raw bytes of the stream. Raises ControlClosed
        at the end of the stream, KVTransferError TIMEOUT past deadline (the stream is then out of step)."""
        self.read_into_all([view], deadline)

    def skip(self, nbytes: int, deadline: float) -> None:
        """Reads and drops the next nbytes raw bytes (an inline transfer the receiver declined)."""
        scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
        while nbytes > 0:
            take = min(nbytes, len(scratch))
            self.read_into(scratch[:take], deadline)
            nbytes -= take

    def close(self) -> None:
        """Ends the connection (both directions); a receive blocked on another thread raises ControlClosed."""
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _read(self, nbytes: int, deadline: float | None) -> bytearray:
        buffer = bytearray(nbytes)
        self.read_into(memoryview(buffer), deadline)
        return buffer

    def _io(self, op, deadline: float | None, what: str, *args):
        """op(*args) on the socket within deadline (None: no limit). Raises ControlClosed, or KVTransferError
        TIMEOUT."""
        if self._closed:
            raise ControlClosed(f"control connection to {self.peer} is closed")
        timeout = None if deadline is None else deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            raise KVTransferError(TransferStatus.TIMEOUT, f"control {what} to {self.peer}: deadline passed")
        try:
            self.sock.settimeout(timeout)
            return op(*args)
        except socket.timeout:
            raise KVTransferError(TransferStatus.TIMEOUT, f"control {what} to {self.peer} timed out") from None
        except OSError as exc:
            raise ControlClosed(f"control {what} to {self.peer} failed: {exc}") from None


_MAX_IOV = 1024  # buffers per sendmsg / recvmsg_into (Linux's IOV_MAX)


def _past(views: list[memoryview], count: int) -> list[memoryview]:
    """The views that remain once the first count bytes of them were moved (the first one cut where they end)."""
    if count == sum(map(len, views)):  # the usual case: one call moved them all
        return []
    index = 0
    while index < len(views) and count >= len(views[index]):
        count -= len(views[index])
        index += 1
    rest = views[index:]
    if rest and count:
        rest[0] = rest[0][count:]
    return rest


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"
