"""tests/support/ray_start.py: only Ray's own startup timeouts are retried, once; the failed attempt's
processes are killed before the retry."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.support.ray_start import start_ray
from tests.support.serve_process import live_processes


def flaky_start(errors: list[Exception], spawned: list[int]):
    """A start() that leaves a process behind and raises errors[0], errors[1] ... then returns 'up'."""
    def start() -> str:
        if errors:
            spawned.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]).pid)
            raise errors.pop(0)
        return "up"
    return start


@pytest.mark.parametrize("message", ["The current node timed out during startup",
                                     "Timed out waiting for file /tmp/ray/session_x/gcs_server_port_abc"])
def test_a_ray_startup_timeout_is_retried_once_and_its_processes_killed(message):
    spawned: list[int] = []
    assert start_ray(flaky_start([RuntimeError(message)], spawned)) == "up"
    assert spawned and spawned[0] not in live_processes()


def test_a_second_timeout_or_any_other_error_fails():
    spawned: list[int] = []
    with pytest.raises(RuntimeError, match="during startup"):
        start_ray(flaky_start([RuntimeError("timed out during startup")] * 2, spawned))
    with pytest.raises(ValueError, match="bad address"):
        start_ray(flaky_start([ValueError("bad address")], spawned))
    killed_by_retry, *left = spawned  # the retried attempt's process was killed; the last attempts' are ours
    assert killed_by_retry not in live_processes() and all(pid in live_processes() for pid in left)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
