"""The C heap of a process that runs CPU steps: keep freed memory for the next step instead of giving it back.

A CPU step allocates and frees tensors of megabytes (a 512-token prefill: 6 MiB per MLP projection, per layer;
a decode step's logits: 4.5 MiB at 24 rows). glibc's malloc serves such sizes with fresh mmap()s, or trims its
heap after the free, so every step page-faulted its activations in again: ~14,000 minor faults per 512-token
prefill of SmolLM2, each page zeroed by the kernel while the step's other OpenMP thread waits at the next barrier.
With mmap's threshold at glibc's maximum (32 MiB) and the heap kept up to HEAP_KEEP_BYTES, the same prefill takes
~20 faults (getrusage), and took 593-769 ms against 680-849 ms in three alternating pairs of processes on a
2-core host (docs/benchmarks.md). vLLM's CPU guide gets the same from tcmalloc (LD_PRELOAD); this needs no
library. The settings are the process's (mallopt), for every thread's arena; a no-op where the C library is
not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger("tandem.engine")

M_TRIM_THRESHOLD = -1   # mallopt parameters (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest on 64-bit: below it, blocks come from the heap and are reused
HEAP_KEEP_BYTES = 512 << 20      # free memory at the heap's top kept for later steps, not trimmed


def keep_freed_host_memory() -> bool:
    """Set the calling process's malloc to reuse freed step-sized blocks (see the module docstring). True when
    glibc took both settings; False (nothing changed) elsewhere. Idempotent."""
    libc = _glibc()
    if libc is None:
        return False
    took = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and \
        libc.mallopt(M_TRIM_THRESHOLD, HEAP_KEEP_BYTES) == 1
    if not took:
        logger.debug("mallopt refused the heap settings: steps keep page-faulting their activations")
    return took


def _glibc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # only glibc has it (and mallopt with these parameters)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc
