"""The links between rank 0 and its followers' lanes: a Unix socket in a directory only this user can open, one
authenticated connection per follower (multiprocessing.connection: an HMAC challenge with a key rank 0 drew, then
framed messages of kv_transfer/lanes/messages.py).

LaneHub (rank 0) accepts the followers, learns their lane targets and KV heads from their Hello, sends them
commands and hands every LaneEnded to its owner's callback; a follower whose link ends is reported once as lost.
Once every follower has joined, the socket and its directory are removed (nothing else may join; nothing is left
behind if rank 0's process is killed later). FollowerLink (a follower) connects, says Hello and serves rank 0's
commands on a thread of its own.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from typing import Callable

from kv_transfer.lanes.messages import Hello, LaneEnded

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubAddress:
    """Where a follower finds rank 0's hub, and the key it proves (pickled into the followers; never logged)."""

    path: str
    authkey: bytes = field(repr=False)


class LaneHub:
    """Rank 0's end of the links. on_ended(LaneEnded) runs on a link's reader thread for every report;
    on_lost(rank) once when a follower's link ends before close(). Both must not block."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="tandem-lanes-")  # mode 0700: only this user reaches the socket
        self.address = HubAddress(os.path.join(self._dir, "hub"), secrets.token_bytes(32))
        self._listener = Listener(self.address.path, family="AF_UNIX", authkey=self.address.authkey)
        self._links: dict[int, Connection] = {}
        self.targets: dict[int, str] = {}
        self.heads: dict[int, tuple[int, int]] = {}  # each follower's KV heads, from its Hello
        self._send_locks: dict[int, threading.Lock] = {}
        self._joined = threading.Condition()
        self._closed = self._accepting_done = False
        self.on_ended: Callable[[LaneEnded], None] = lambda ended: None
        self.on_lost: Callable[[int], None] = lambda rank: None
        threading.Thread(target=self._accept, name="kv-lane-hub", daemon=True).start()

    def wait_followers(self, ranks: range, timeout_s: float) -> None:
        """Until every rank in ranks said Hello, then stops accepting and removes the socket's directory; ValueError
        past timeout_s."""
        with self._joined:
            if not self._joined.wait_for(lambda: set(ranks) <= set(self._links), timeout_s):
                missing = sorted(set(ranks) - set(self._links))
                raise ValueError(f"KV lanes of ranks {missing} did not join within {timeout_s:.0f} s")
        self._stop_accepting()

    def send(self, rank: int, message: object) -> bool:
        """Sends message to follower `rank`; False when its link is gone (it is reported lost then)."""
        link = self._links.get(rank)
        if link is None:
            return False
        try:
            with self._send_locks[rank]:
                link.send(message)
            return True
        except (OSError, EOFError, ValueError):
            return False

    def close(self) -> None:
        """Closes the listener and every link and removes the socket's directory. Idempotent."""
        with self._joined:
            if self._closed:
                return
            self._closed = True
            links = list(self._links.values())
        self._stop_accepting()
        for link in links:
            link.close()

    def _stop_accepting(self) -> None:
        """Ends the accept thread (a connection of our own wakes its accept(): closing a listening socket does
        not), closes the listener and removes the socket's directory. Idempotent."""
        with self._joined:
            if self._accepting_done:
                return
            self._accepting_done = True
        try:
            Client(self.address.path, family="AF_UNIX", authkey=self.address.authkey).close()
        except OSError:
            pass
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _accept(self) -> None:
        """Until _stop_accepting's own connection comes (the flags are read only after an accept returns, so that
        connection always finds this thread in accept() or on its way back to it)."""
        while True:
            try:
                link = self._listener.accept()  # the key's challenge both ways, before anything is unpickled
                if self._accepting_done:  # the wake-up connection of _stop_accepting
                    link.close()
                    return
                hello = link.recv() if link.poll(10.0) else None
            except Exception as exc:  # noqa: BLE001 - a refused or broken connection
                if self._accepting_done:
                    return
                log.warning("kv lane hub: connection refused: %s", exc)
                continue
            if not isinstance(hello, Hello):
                link.close()
                continue
            with self._joined:
                self._links[hello.rank], self.targets[hello.rank] = link, hello.target
                self.heads[hello.rank] = hello.heads
                self._send_locks[hello.rank] = threading.Lock()
                self._joined.notify_all()
            threading.Thread(target=self._read, args=(hello.rank, link), name=f"kv-lane-hub-{hello.rank}",
                             daemon=True).start()

    def _read(self, rank: int, link: Connection) -> None:
        try:
            while True:
                message = link.recv()
                if isinstance(message, LaneEnded) and message.rank == rank:
                    self.on_ended(message)
        except (OSError, EOFError):
            pass
        with self._joined:
            if self._links.get(rank) is link:
                del self._links[rank]
            closed = self._closed
        if not closed:
            log.warning("kv lane of rank %d: its link ended", rank)
            self.on_lost(rank)


class FollowerLink:
    """A follower's end: connects to the hub (retrying for up to connect_timeout_s while rank 0 starts), says
    Hello, then runs handle(message) for each of rank 0's commands on its own thread until the link ends."""

    def __init__(self, address: HubAddress, hello: Hello, handle: Callable[[object], None],
                 connect_timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + connect_timeout_s
        while True:
            try:
                self._link = Client(address.path, family="AF_UNIX", authkey=address.authkey)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._lock = threading.Lock()
        self.report(hello)
        self._thread = threading.Thread(target=self._serve, args=(handle,), name=f"kv-lane-{hello.rank}",
                                        daemon=True)
        self._thread.start()

    def report(self, message: object) -> None:
        """Sends message to rank 0 (a LaneEnded); a link that is gone drops it (rank 0 saw it lost)."""
        try:
            with self._lock:
                self._link.send(message)
        except (OSError, EOFError, ValueError):
            pass

    def close(self) -> None:
        self._link.close()
        self._thread.join(5.0)

    def _serve(self, handle: Callable[[object], None]) -> None:
        try:
            while True:
                handle(self._link.recv())
        except (OSError, EOFError, TypeError):  # closed here (TypeError: a closed handle) or by rank 0
            pass
