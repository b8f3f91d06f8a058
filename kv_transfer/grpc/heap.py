"""Keeps glibc from returning gRPC's per-message buffers to the kernel after every message.

gRPC-python allocates fresh memory for every socket read (in gRPC core) and for every message it hands
to Python (a `bytes` of ~grpc_chunk_bytes). With glibc's defaults these buffers come from mmap, or from a
heap top that free() trims again, so every page is faulted in anew: measured ~6,000 page faults and
20-30 ms of receiver CPU per 64 MiB transfer on the 2-core dev box (`python -m kv_transfer.bench`). Raising
glibc's mmap and trim thresholds keeps freed buffers in the heap for the next message.
"""
from __future__ import annotations

import ctypes
import logging
import threading

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
_MIN_MMAP_THRESHOLD = 4 << 20
_MAX_MMAP_THRESHOLD = 32 << 20  # glibc ignores larger values (HEAP_MAX_SIZE / 2 on 64-bit)
_TRIM_FACTOR = 8

_lock = threading.Lock()
_mmap_threshold = 0  # what this module last set (0: nothing yet)


def keep_heap_for_messages(message_bytes: int) -> bool:
    """Process-wide and idempotent: sets glibc's M_MMAP_THRESHOLD to hold messages of message_bytes
    (twice that, at least 4 MiB, at most 32 MiB) and M_TRIM_THRESHOLD to 8x that, so each glibc arena keeps
    up to that much freed memory mapped instead of trimming it. Only ever raises what an earlier call set.
    Setting these turns off glibc's dynamic mmap threshold for the whole process. Returns True when the
    settings are in effect, False where mallopt is unavailable (not glibc) or refused them."""
    global _mmap_threshold
    wanted = min(max(2 * message_bytes, _MIN_MMAP_THRESHOLD), _MAX_MMAP_THRESHOLD)
    with _lock:
        if _mmap_threshold >= wanted:
            return True
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (AttributeError, OSError):
            return False
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        if not (mallopt(_M_MMAP_THRESHOLD, wanted) and mallopt(_M_TRIM_THRESHOLD, _TRIM_FACTOR * wanted)):
            log.warning("mallopt refused the KV transfer heap thresholds; gRPC transfers will page-fault more")
            return False
        _mmap_threshold = wanted
        return True
