"""OpenMP thread pools: one per thread that ran parallel work, and why a serving process keeps only the stepping one.

torch and the numba kernels share one OpenMP runtime (libgomp). Every thread that runs a parallel region gets a
pool of its own workers, and libgomp counts the workers of all pools: once there are more than the CPUs it may
use, it stops letting idle workers spin (100 spins, against 300,000 otherwise, GOMP_SPINCOUNT's documentation),
so a worker sleeps between two ops and the next parallel op waits for it to wake. A serving process builds its
engine on one thread (loading and warming it runs parallel work there) and steps it on another (the engine loop,
a worker's step thread): two pools, and each parallel op of a step could wait for a sleeping worker. Measured
(docs/benchmarks.md, session 16): offline, an idle second pool made the engine's two threads use 1.58 of the
host's 2 cores and decode steps 10-25% slower; served in process at 1 req/s, the host sat 18% idle while the
engine stepped, 5% once the building thread released its pool, and output throughput went 48.7 / 47.0 ->
51.6 / 55.3 tok/s, TPOT p50 277 / 377 -> 254 / 226 ms (two alternating pairs).

release_openmp_pool() gives the calling thread's pool back (OpenMP 5.0's omp_pause_resource_all, which libgomp
implements as freeing the caller's pool); start_stepping_thread() is where the building thread does so, as it
starts the thread that steps the engine. Should the building thread run parallel work again, a new pool is made.
"""
from __future__ import annotations

import ctypes
import logging
import threading

logger = logging.getLogger("tandem.engine")

OMP_PAUSE_SOFT = 1


def release_openmp_pool() -> int:
    """Frees the calling thread's OpenMP worker pool in every OpenMP runtime loaded in this process that
    implements omp_pause_resource_all (libgomp, Intel's libiomp). Returns how many runtimes freed one; 0 when
    none is loaded or none has the call. Call it from a thread that will not step an engine."""
    released = 0
    for path in _loaded_openmp_runtimes():
        try:
            runtime = ctypes.CDLL(path)  # already loaded: the same library, not a second copy
            pause = runtime.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = (ctypes.c_int,), ctypes.c_int
        if pause(OMP_PAUSE_SOFT) == 0:
            released += 1
    logger.debug("released this thread's OpenMP pool in %d runtime(s)", released)
    return released


def start_stepping_thread(thread: threading.Thread) -> None:
    """Starts `thread`, which will step an engine the calling thread built, once the calling thread has given its
    OpenMP pool back (release_openmp_pool): the one hand-over every engine loop and worker makes."""
    release_openmp_pool()
    thread.start()


def _loaded_openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux: /proc/self/maps; elsewhere none)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return []
    names = ("libgomp", "libiomp", "libomp")
    return sorted(p for p in paths if p.startswith("/") and any(n in p.rsplit("/", 1)[-1] for n in names))
