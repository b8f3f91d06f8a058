"""Host memory for a CPU KV pool: zeroed pages from the OS, committed when first written or all at start.

An anonymous mapping comes zeroed from the kernel and costs nothing until it is written; then each first write to
a 4 KiB page takes a page fault, in which the kernel finds and zeroes the page (~5 us here). The allocator hands
out the least recently freed block first (engine/kv/block_allocator.py), so until every block of the pool has been
used once each prompt writes fresh pages: a 512-token prompt of SmolLM2-135M (30 layers, 3 KV heads of 64) takes
5,760 faults in its K/V stores, ~4% of its prefill on a 2-core host (854 against 817 ms p50), and a served pool of
several GiB stays in that first pass for hours of traffic (docs/benchmarks.md). Committing the pages at start with
madvise(MADV_POPULATE_WRITE) (Linux 5.14+) costs ~0.35 s a GiB once, as vLLM's CPU server allocates its pool
resident. Where that call is refused, writing a zero to each page commits it the slow way.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MADV_POPULATE_WRITE = 23  # Linux's value (uapi/asm-generic/mman-common.h); elsewhere madvise refuses it
POPULATE_THREADS = 2  # the kernel's populate scales little past two threads (0.47 -> 0.34 s a GiB here)


def zeroed_host_bytes(num_bytes: int) -> np.ndarray:
    """num_bytes of zeroed, page-aligned, writable host memory as a uint8 array, committed page by page as it is
    first written; freed when the array (and every view of it) is gone."""
    if num_bytes == 0:
        return np.zeros(0, dtype=np.uint8)
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
    return np.frombuffer(mmap.mmap(-1, num_bytes, **private), dtype=np.uint8)  # zero pages, this process's own


def commit_pages(array: np.ndarray) -> None:
    """Commit every page of array's memory (flat uint8, contiguous) now, so no later write takes a page fault.
    Writes nothing where the kernel populates; elsewhere writes a zero to the first byte of each page, so call it
    only on memory whose contents are still all zero (a pool before its first use)."""
    if array.nbytes and not _populate(array.ctypes.data, array.nbytes):
        array[::mmap.PAGESIZE] = 0


def _populate(address: int, num_bytes: int) -> bool:
    """madvise(MADV_POPULATE_WRITE) over [address, address + num_bytes), split between threads (ctypes lets go of
    the GIL during the call; mmap.madvise does not); False where the OS refuses it or has no madvise."""
    madvise = _libc_madvise()
    if madvise is None or address % mmap.PAGESIZE:
        return False
    chunk = -(-num_bytes // POPULATE_THREADS // mmap.PAGESIZE) * mmap.PAGESIZE
    spans = [(address + start, min(chunk, num_bytes - start)) for start in range(0, num_bytes, chunk)]
    with ThreadPoolExecutor(max_workers=len(spans)) as pool:
        results = list(pool.map(lambda span: madvise(span[0], span[1], MADV_POPULATE_WRITE), spans))
    return all(result == 0 for result in results)


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise
