"""Starting Ray in tests on a loaded machine: one retry when Ray's own node startup times out.

On the 2-core CI machine Ray's own processes have, rarely, not come up within Ray's fixed timeouts: a raylet
(`ray.init` or `Cluster.add_node` raises "The current node timed out during startup"; the raylet wrote no
log at all, seen in 2 of about 10 full runs) or the GCS server ("Timed out waiting for file .../
gcs_server_port_...", once in about 10), and the failed attempt leaves its other processes running. That is
Ray's startup, not Tandem: the attempt's processes are killed and it is tried once more. Any other error,
or a second timeout, fails the test as before.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Callable, TypeVar

import ray

from tests.support.serve_process import descendants, live_processes

T = TypeVar("T")
RAY_STARTUP_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")
ATTEMPTS = 2


def start_ray(start: Callable[[], T]) -> T:
    """start(), once more if Ray's node startup timed out (the failed attempt's processes killed first)."""
    for attempt in range(1, ATTEMPTS + 1):
        before = descendants(os.getpid())
        try:
            return start()
        except Exception as error:  # noqa: BLE001 - only Ray's startup timeout is retried
            if not any(timeout in str(error) for timeout in RAY_STARTUP_TIMEOUTS) or attempt == ATTEMPTS:
                raise
            ray.shutdown()
            _kill(descendants(os.getpid()) - before)
    raise AssertionError("unreachable")


def _kill(pids: set[int], timeout_s: float = 10.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while pids & set(live_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
