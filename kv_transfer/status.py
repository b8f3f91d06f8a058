"""Outcome codes of a transfer (mirrored by tandem.v1.KVStatus) and the error that carries them."""
from __future__ import annotations

from enum import IntEnum


class TransferStatus(IntEnum):
    OK = 0
    REJECTED_FINGERPRINT = 1
    REJECTED_NO_BLOCKS = 2
    MALFORMED = 3
    CANCELLED = 4
    CHECKSUM_MISMATCH = 5
    LENGTH_MISMATCH = 6
    TIMEOUT = 7
    PEER_FAILED = 8
    ABORTED_BY_SENDER = 9
    INTERNAL = 10
    REJECTED_BUSY = 11  # the receiver's queue of waiting transfers is full
    UNAUTHENTICATED = 12  # the receiver refused the stream: missing or wrong cluster secret (gRPC status)


class KVTransferError(RuntimeError):
    """A transfer that ended without delivering the blocks; status says why, message says the details."""

    def __init__(self, status: TransferStatus, message: str, request_id: str = ""):
        self.status = TransferStatus(status)
        self.message = message
        self.request_id = request_id
        prefix = f"[{request_id}] " if request_id else ""
        super().__init__(f"{prefix}{self.status.name}: {message}")
