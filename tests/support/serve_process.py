"""`tandem serve` as a real subprocess on free loopback ports, as users run it."""
from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys

import pytest

TANDEM = [sys.executable, "-m", "cluster.cli"]


@contextlib.contextmanager
def start_serve(*args: str):
    """Runs `tandem serve ... --grpc-port 0 --http-port 0` and yields (process, gRPC port, HTTP port) once
    it listens; SIGTERMs it at the end if it still runs."""
    proc = subprocess.Popen([*TANDEM, "serve", "--grpc-port", "0", "--http-port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner = ""
        for line in proc.stdout:
            banner += line
            match = re.search(r"gRPC 127\.0\.0\.1:(\d+), HTTP http://127\.0\.0\.1:(\d+)/v1", line)
            if match:
                yield proc, int(match.group(1)), int(match.group(2))
                break
        else:
            pytest.fail(f"tandem serve exited before listening:\n{banner}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
