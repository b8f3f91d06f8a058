"""PairStore: the torch.distributed Store a pair's data-plane process group meets through, carried by the
pair's authenticated control connection instead of an open TCPStore.

Both ends build their process group at the same time (the sender's CONNECT frame starts it); torch calls
set / get / wait on this store from inside the group's constructor (gloo: the device addresses; nccl:
the unique id). A set goes to the other end as one STORE_SET frame; a get or wait reads STORE_SET frames
until the key is known. Nothing else travels on the connection while a group connects, and the store only
lives for that one connection epoch.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from kv_transfer.control.connection import ControlConnection, Kind
from kv_transfer.status import KVTransferError, TransferStatus

MAX_STORE_FRAME_BYTES = 64 << 10  # gloo's addresses and nccl's unique id are a few hundred bytes
PEER_ADD_PREFIX = "\0peer-add\0"  # the other end's running total of a counter travels under this prefix


class PairStore(dist.Store):
    """A two-party key-value store over one control connection, valid while one process group connects."""

    def __init__(self, conn: ControlConnection, timeout_s: float):
        super().__init__()
        self.conn, self.timeout_s = conn, timeout_s
        self._values: dict[str, bytes] = {}
        self._own_adds: dict[str, int] = {}  # add(): this end's running total per counter

    def set(self, key: str, value) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._values[key] = data
        self.conn.send(Kind.STORE_SET, [key, data], self._deadline())

    def get(self, key: str) -> bytes:
        if key in self._own_adds:
            return str(self._sum(key)).encode()
        self._await([key], self._deadline())
        return self._values[key]

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        limit = self.timeout_s if timeout is None else min(self.timeout_s, timeout.total_seconds())
        self._await(list(keys), time.monotonic() + limit)

    def check(self, keys) -> bool:
        return all(key in self._values for key in keys)

    def add(self, key: str, amount: int) -> int:
        """Adds to a counter both ends may add to: each end sends its own running total under a key of its
        own, and the value is the sum of both (so two adds of 1 make 2, whoever's frame arrives first)."""
        own = self._own_adds[key] = self._own_adds.get(key, 0) + amount
        self.conn.send(Kind.STORE_SET, [PEER_ADD_PREFIX + key, str(own).encode()], self._deadline())
        return self._sum(key)

    def _sum(self, key: str) -> int:
        return self._own_adds.get(key, 0) + int(self._values.get(PEER_ADD_PREFIX + key, b"0"))

    def delete_key(self, key: str) -> bool:
        return self._values.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self._values)

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _await(self, keys: list[str], deadline: float) -> None:
        while not self.check(keys):
            _, payload = self.conn.receive(MAX_STORE_FRAME_BYTES, deadline, (Kind.STORE_SET,))
            if not (isinstance(payload, list) and len(payload) == 2 and isinstance(payload[0], str)
                    and isinstance(payload[1], bytes)):
                raise KVTransferError(TransferStatus.MALFORMED, "bad rendezvous frame")
            self._values[payload[0]] = payload[1]
