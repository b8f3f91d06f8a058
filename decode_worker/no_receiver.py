"""NoReceiver: the KV receiver of a decode worker that receives no KV (a colocated replica).

A colocated replica (`tandem serve --replicas N`) is a decode worker that prefills every prompt itself:
no prefill worker ever sends it KV, so it opens no KV port and runs no receiver threads. This stands in
for the receiver (DecodeWorkerConfig.transport == NO_TRANSPORT): nothing ever arrives.
"""
from __future__ import annotations

import threading

NO_TRANSPORT = "none"


class NoReceiver:
    """The KVReceiver interface, with nothing to receive. Any thread."""

    address = None

    @property
    def dropped_connections(self) -> dict[str, int]:
        """Nothing listens, so nothing is dropped."""
        return {}

    def __init__(self) -> None:
        self._closed = threading.Event()

    def wait(self, timeout: float | None = None) -> None:
        """Sleeps `timeout` (or until close()); nothing ever arrives."""
        self._closed.wait(timeout)

    def poll(self) -> list:
        return []

    def deliver_to(self, sink) -> None:
        pass  # nothing will ever be delivered

    def cancel(self, request_id: str) -> None:
        pass

    def add_peer(self, rank: int) -> None:
        pass

    def remove_peer(self, rank: int) -> None:
        pass

    def close(self) -> None:
        self._closed.set()
