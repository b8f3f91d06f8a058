"""One `tandem serve` subprocess per serving mode of `tandem bench compare`.

    with ServerProcess(["--mode", "colocated"], log_path, start_timeout_s=300) as server:
        ... drive server.base_url ...
    # SIGTERM, then SIGKILL if it has not exited within stop_timeout_s

The server binds 127.0.0.1 on ports the OS picks (0) and announces them on stdout; everything it
prints goes to `log_path`. A server that exits or stays silent past the start timeout raises
ServerStartError with the tail of its log.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

_ANNOUNCE = re.compile(r"^tandem serving .* HTTP (http://[\d.]+:\d+)/v1")


def file_tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a server's log ("" if it cannot be read)."""
    with contextlib.suppress(OSError):
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    return ""


class ServerStartError(RuntimeError):
    """`tandem serve` exited or did not announce its ports in time."""


class ServerProcess:
    """A `tandem serve` subprocess with the given extra flags; a context manager that stops it."""

    def __init__(self, serve_flags: list[str], log_path: Path, start_timeout_s: float = 300.0,
                 stop_timeout_s: float = 60.0) -> None:
        self.argv = [sys.executable, "-m", "cluster.cli", "serve", "--host", "127.0.0.1",
                     "--http-port", "0", "--grpc-port", "0", *serve_flags]
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.base_url = ""
        self._process: subprocess.Popen | None = None
        self._announced = threading.Event()
        self._log_thread: threading.Thread | None = None

    def __enter__(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._process = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                         start_new_session=True)
        self._log_thread = threading.Thread(target=self._copy_log, daemon=True, name="serve-log")
        self._log_thread.start()
        try:
            self._wait_until_announced()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        """The `tandem serve` process's id (the root of its process tree: Ray's processes are below it)."""
        return None if self._process is None else self._process.pid

    def _copy_log(self) -> None:
        """Copies the server's output into the log file and catches the announced HTTP address."""
        with open(self.log_path, "w") as log:
            for line in self._process.stdout:
                log.write(line)
                log.flush()
                match = _ANNOUNCE.match(line)
                if match and not self._announced.is_set():
                    self.base_url = match.group(1)
                    self._announced.set()

    def _wait_until_announced(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not self._announced.wait(timeout=0.2):
            if self._process.poll() is not None:
                raise ServerStartError(f"tandem serve exited with code {self._process.returncode}:\n"
                                       f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ServerStartError(f"tandem serve did not announce its ports within "
                                       f"{self.start_timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        return file_tail(self.log_path, lines)

    def metrics_text(self) -> str:
        """GET /metrics (Prometheus text)."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
            return response.read().decode()

    def stop(self) -> int | None:
        """SIGTERM (the server stops everything it started, Ray included); if it has not exited after
        stop_timeout_s, SIGKILL to its whole process group (its own session). Returns the exit code."""
        if self._process is None:
            return None
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        if self._log_thread is not None:
            self._log_thread.join(timeout=5)
        return self._process.returncode
