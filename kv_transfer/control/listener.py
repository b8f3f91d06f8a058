"""ControlListener: the receiver's one listening socket of the KV control plane.

It binds the node address it is given (never all interfaces) on a free port, and runs each accepted
connection on a thread of its own: the cluster-secret handshake first (handshake.py, bounded by a
deadline), then the caller's `serve`, on the same thread, for as long as the connection lives. A peer that
fails the handshake (no secret, a wrong one, garbage, too slow) or that the caller does not admit is
dropped before anything else is read from it; each drop is logged and counted by reason (`drops`).
"""
from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from typing import Callable

from kv_transfer.control.connection import ControlConnection
from kv_transfer.control.handshake import PeerHello, listener_handshake, welcome
from kv_transfer.status import KVTransferError, TransferStatus

log = logging.getLogger(__name__)
MAX_PENDING_HANDSHAKES = 32  # connections past this many still in their handshake are dropped at once


class ControlListener:
    """Accepts authenticated control connections for one receiver.

    admit(hello) says whether this receiver serves that sender (rank, lane) now; serve(hello, conn) runs
    an admitted connection on its thread and returns when it ends (the listener then forgets it)."""

    def __init__(self, host: str, secret: str | None, namespace: str,
                 admit: Callable[[PeerHello], bool], serve: Callable[[PeerHello, ControlConnection], None],
                 handshake_timeout_s: float = 10.0):
        self.secret, self.namespace = secret, namespace
        self.admit, self.serve, self.handshake_timeout_s = admit, serve, handshake_timeout_s
        self.drops: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._pending = 0
        self._connections: set[ControlConnection] = set()
        self._closed = False
        self._socket = socket.create_server((host, 0))
        self.host, self.port = self._socket.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, name="kv-control-accept", daemon=True)
        self._thread.start()

    @property
    def target(self) -> str:
        """host:port, what a sender connects to."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stops accepting and ends every connection (their serve() calls return); waits for the accept
        thread."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()
        for conn in connections:
            conn.close()
        self._thread.join(5)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, address = self._socket.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                crowded = self._pending >= MAX_PENDING_HANDSHAKES
                self._pending += not crowded
            if crowded:
                self._drop(ControlConnection(sock), "too_many_pending", "too many connections in their handshake")
                continue
            threading.Thread(target=self._run_connection, args=(ControlConnection(sock),),
                             name=f"kv-control-{address[1]}", daemon=True).start()

    def _run_connection(self, conn: ControlConnection) -> None:
        hello = self._authenticate(conn)
        with self._lock:
            self._pending -= 1
            if hello is None or self._closed:
                conn.close()
                return
            self._connections.add(conn)
        try:
            self.serve(hello, conn)
        except Exception:  # noqa: BLE001 - one link's bug must not end the listener
            log.exception("kv control connection from %s (rank %d) failed", conn.peer, hello.rank)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _authenticate(self, conn: ControlConnection) -> PeerHello | None:
        """The handshake, then admission; None (counted, logged) when the peer is dropped."""
        deadline = time.monotonic() + self.handshake_timeout_s
        try:
            hello = listener_handshake(conn, self.secret, self.namespace, deadline)
        except KVTransferError as exc:
            reason = {TransferStatus.UNAUTHENTICATED: "unauthenticated", TransferStatus.TIMEOUT: "timeout",
                      TransferStatus.PEER_FAILED: "closed"}.get(exc.status, "garbage")
            self._drop(conn, reason, exc.message)
            return None
        if not self.admit(hello):
            self._drop(conn, "not_a_peer", f"rank {hello.rank} lane {hello.lane} is not a sender of this receiver")
            return None
        try:
            welcome(conn, deadline)
        except KVTransferError as exc:
            self._drop(conn, "closed", exc.message)
            return None
        return hello

    def _drop(self, conn: ControlConnection, reason: str, message: str) -> None:
        with self._lock:
            self.drops[reason] += 1
        log.warning("kv control: dropped a connection from %s (%s): %s", conn.peer, reason, message)
        conn.close()
