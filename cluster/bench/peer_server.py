"""The peer side of `tandem bench peer`: vLLM's OpenAI server started through a runner script, or any server by URL.

    with VllmServer(runner, model_dir, log_path) as peer:   # ../shared/peers/vllm-cpu.sh run -m vllm...api_server
        ... drive peer.base_url ...
    with ExternalServer("http://127.0.0.1:8000") as peer:   # started and stopped by someone else

Both answer GET /v1/models before they are handed out: a peer that exits, or stays silent past the start
timeout, raises ServerStartError with the tail of its log, and the benchmark reports it without figures.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from cluster.bench.compare_server import ServerStartError, file_tail

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server that cannot be told to pick one itself)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def models_answer(base_url: str, timeout_s: float = 5.0) -> bool:
    """Whether GET /v1/models answers 200 with a model list."""
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=timeout_s) as response:
            return response.status == 200 and bool(json.loads(response.read()).get("data"))
    except (OSError, ValueError, urllib.error.URLError):
        return False


class ExternalServer:
    """A server someone else runs: checked to answer on enter, left running on exit."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def __enter__(self) -> "ExternalServer":
        if not models_answer(self.base_url):
            raise ServerStartError(f"the peer at {self.base_url} does not answer GET /v1/models")
        return self

    def __exit__(self, *exc_info) -> None:
        return None


class VllmServer:
    """vLLM's OpenAI API server as a subprocess of `runner run` (the peers' runner script: it picks the venv and
    the CPU settings), in its own session so that stopping it stops its engine process too."""

    def __init__(self, runner: str, model_dir: Path, log_path: Path, start_timeout_s: float = 600.0,
                 extra_args: tuple[str, ...] = ()) -> None:
        port = free_loopback_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.argv = [runner, "run", "-m", VLLM_SERVER_MODULE, "--model", str(model_dir), "--host", "127.0.0.1",
                     "--port", str(port), "--dtype", "float32", "--gpu-memory-utilization", "0.5", *extra_args]
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> "VllmServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self._process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_until_answering()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _wait_until_answering(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not models_answer(self.base_url, timeout_s=2.0):
            if self._process.poll() is not None:
                raise ServerStartError(f"the peer server exited with code {self._process.returncode}:\n"
                                       f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ServerStartError(f"the peer server did not answer within {self.start_timeout_s:.0f} s:\n"
                                       f"{self.log_tail()}")
            time.sleep(1.0)

    def log_tail(self, lines: int = 20) -> str:
        return file_tail(self.log_path, lines)

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s."""
        if self._process is None or self._process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGTERM)
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
