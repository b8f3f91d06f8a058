"""`tandem serve` as a real subprocess on free loopback ports, as users run it, and the processes it leaves.

The subprocess runs in a session of its own (start_new_session=True), so a test can signal its whole
process group (what `kill -- -PGID` sends) without signalling pytest. What it starts is found in /proc:
its descendants, and the sessions it and they lead (the local Ray's RayHost runs in one of its own).
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

TANDEM = [sys.executable, "-m", "cluster.cli"]


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    session: int
    command: str   # /proc/PID/cmdline, e.g. ".../raylet --raylet_socket_name=...", "ray::DecodeActor"


def live_processes() -> dict[int, ProcessInfo]:
    """Every live (non-zombie) process, from /proc."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            pid = int(stat.parent.name)
            found[pid] = ProcessInfo(pid, int(fields[1]), int(fields[3]), _command(stat.parent))
    return found


def _command(proc_dir: Path) -> str:
    try:
        return proc_dir.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`."""
    children: dict[int, list[int]] = {}
    for info in live_processes().values():
        children.setdefault(info.ppid, []).append(info.pid)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def started_sessions(proc: subprocess.Popen) -> set[int]:
    """The sessions `proc` and its descendants lead (proc runs in its own session): everything it started
    lives in one of them, even a process that was reparented since."""
    processes = live_processes()
    below = descendants(proc.pid)
    return {proc.pid} | {pid for pid in below if processes[pid].session == pid}


def session_processes(sessions: set[int]) -> dict[int, ProcessInfo]:
    return {pid: info for pid, info in live_processes().items() if info.session in sessions}


def wait_until_gone(sessions: set[int], timeout_s: float) -> dict[int, ProcessInfo]:
    """Waits until no process of `sessions` is alive; returns those still alive at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (left := session_processes(sessions)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_sessions(sessions: set[int]) -> None:
    """SIGKILL, by pid, every process still alive in `sessions` (test cleanup)."""
    for pid in session_processes(sessions):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def start_serve(*args: str):
    """Runs `tandem serve ... --grpc-port 0 --http-port 0` in its own session and yields (process, gRPC
    port, HTTP port) once it listens. At the end: SIGTERM if it still runs, SIGKILL if it does not exit
    in 60 s, then SIGKILL for anything left of the sessions it started."""
    model = () if "--model" in args else ("--model", "tiny")  # the embedded model unless the test names one
    # The pools, sized from the host's memory, stay lazy: committing GiBs at each start would cost the suite ~3 s a
    # server, and tests/engine/test_resident_kv_cache.py checks the commit itself.
    lazy = () if "--kv-cache-resident" in args else ("--no-kv-cache-resident",)
    proc = subprocess.Popen([*TANDEM, "serve", "--grpc-port", "0", "--http-port", "0", *model, *lazy, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    sessions = {proc.pid}
    try:
        banner = ""
        for line in proc.stdout:
            banner += line
            match = re.search(r"gRPC 127\.0\.0\.1:(\d+), HTTP http://127\.0\.0\.1:(\d+)/v1", line)
            if match:
                sessions |= started_sessions(proc)
                proc.startup_log = banner  # what it printed up to and with the banner
                yield proc, int(match.group(1)), int(match.group(2))
                break
        else:
            pytest.fail(f"tandem serve exited before listening:\n{banner}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        kill_sessions(sessions)
