"""RayHost: the local Ray that `tandem serve` starts, in a process and a session of its own.

    host = start_local_ray(RayHostConfig(num_cpus=4))   # Ray is up; this process is connected to it
    ...
    ray.shutdown(); host.stop()                          # bounded; nothing of that Ray is left

Why a process of its own: a local Ray started by ray.init() in the serve process puts gcs_server, raylet and
Ray's agents in the serve process's process group, so a signal to that group (`kill -- -PGID`, Ctrl-C in
a terminal, a supervisor that signals the group) kills Ray at the moment the serve process begins its
orderly stop, and its last calls to the actors wait on a Ray that is gone. Here the host
(`python -m cluster.workers.ray_host`) is started with start_new_session=True, so Ray and its workers live
in the host's session, out of reach of the serve process's group: the serve process stops the actors
first, then the host. (systemd's default KillMode=control-group signals every process of the unit at
once, the host's session included: then the stop is not orderly but still bounded, cluster/workers/
bounded.py.)

Nothing may outlive the serve process either. The host reads its stdin, a pipe whose only writer is the
serve process: end of file (the serve process closed it, exited, or was SIGKILLed) or SIGTERM/SIGINT makes
the host shut Ray down (ray.shutdown(): raylet first, which ends its workers), then SIGKILL whatever is
still alive in its session (an idle worker, a wedged actor) and exit. stop() closes the pipe, waits, and
kills the host and its session by pid if the host does not finish in time. Linux: processes are found in
/proc (elsewhere only the host itself is killed).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from cluster.workers.bounded import run_bounded

logger = logging.getLogger("tandem.cluster.ray_host")
HOST_SHUTDOWN_TIMEOUT_S = 3.0   # the host's ray.shutdown(), before it kills what is left


@dataclass(frozen=True)
class RayHostConfig:
    """num_cpus: logical CPUs of the local Ray. node_ip: the address its processes bind (loopback).
    start_timeout_s: how long start() waits for Ray to come up. stop_timeout_s: how long stop() waits
    for the host's orderly shutdown before killing it and its session."""

    num_cpus: int
    node_ip: str = "127.0.0.1"
    start_timeout_s: float = 120.0
    stop_timeout_s: float = 8.0

    def __post_init__(self) -> None:
        if self.num_cpus < 1:
            raise ValueError(f"num_cpus must be >= 1, got {self.num_cpus}")
        if self.start_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("start_timeout_s and stop_timeout_s must be > 0")


class RayHost:
    """A running host process and the GCS address of its Ray (`address`, for ray.init)."""

    def __init__(self, process: subprocess.Popen, address: str, config: RayHostConfig) -> None:
        self.process, self.address, self._config = process, address, config
        self._stopped = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        """Whether the host process still runs (it exits after stopping Ray, e.g. on its own SIGTERM)."""
        return self.process.poll() is None

    @classmethod
    def start(cls, config: RayHostConfig) -> RayHost:
        """Start the host and wait until its Ray is up. RuntimeError (the host killed, its session swept)
        if it exits or does not report an address within config.start_timeout_s. The host inherits this
        process's environment (Ray's token authentication settings included)."""
        process = subprocess.Popen(
            [sys.executable, "-m", "cluster.workers.ray_host", json.dumps(dataclasses.asdict(config))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True, text=True)
        found: list[str] = []
        reader = threading.Thread(target=_read_address, args=(process.stdout, found), daemon=True)
        reader.start()
        reader.join(config.start_timeout_s)
        if not found:
            process.kill()
            process.wait()
            kill_session(process.pid)
            raise RuntimeError(f"the local Ray did not start within {config.start_timeout_s:g}s "
                               f"(host exit code {process.returncode})")
        return cls(process, found[0], config)

    def stop(self) -> None:
        """Stop Ray and the host: within config.stop_timeout_s (plus a moment to kill by pid), nothing
        of the host's session is left. Idempotent; call it after ray.shutdown() in this process."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.process.stdin.close()  # end of file: the host shuts Ray down and exits
        except OSError:
            pass
        try:
            self.process.wait(self._config.stop_timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("the local Ray (host pid %d) did not stop within %.0fs; killing it",
                           self.pid, self._config.stop_timeout_s)
            self.process.kill()
            self.process.wait()
        kill_session(self.pid)
        if self.process.stdout is not None:
            self.process.stdout.close()


def start_local_ray(config: RayHostConfig) -> RayHost:
    """Start a RayHost and connect this process to its Ray (ray.init). Stop with ray.shutdown() and then
    host.stop(). Unless RAY_AUTH_MODE is set, the cluster uses token authentication with a token of its
    own, set in this process's environment (which the host and Ray's processes inherit)."""
    if "RAY_AUTH_MODE" not in os.environ:
        _use_token(secrets.token_hex(32))
    host = RayHost.start(config)
    try:
        ray.init(address=host.address, _node_ip_address=config.node_ip, include_dashboard=False)
    except BaseException:
        host.stop()
        raise
    return host


def _use_token(token: str) -> None:
    """Token authentication with `token` for this process and the ones it starts. Ray read RAY_AUTH_MODE
    when it was imported: its config is reloaded, as ray.init() does when it starts a local cluster."""
    from ray._raylet import AuthenticationTokenLoader, Config

    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = token
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _read_address(stdout, found: list[str]) -> None:
    """Appends the address from the host's report line to `found` (nothing if the host ends first)."""
    for line in stdout:
        try:
            found.append(json.loads(line)["address"])
            return
        except (ValueError, KeyError, TypeError):  # not the report: something Ray printed
            continue


def session_members(session: int) -> list[int]:
    """Live (non-zombie) processes whose session id is `session` (from /proc; [] where there is none)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == session:
            members.append(int(stat.parent.name))
    return members


def kill_session(session: int, spare: int | None = None) -> list[int]:
    """SIGKILL every live process of session `session` but `spare`; returns the pids signalled."""
    killed = []
    for pid in session_members(session):
        if pid == spare:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:  # already gone
            pass
    return killed


def _host_main(config: RayHostConfig) -> int:
    """The host process: start Ray, report its address on stdout, serve until stdin ends or a signal,
    then stop Ray and everything in this session."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    ray.init(address="local", _node_ip_address=config.node_ip, include_dashboard=False,
             num_cpus=config.num_cpus, log_to_driver=False, configure_logging=False)
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs a handler that aborts
        signal.signal(sig, lambda *_: stop.set())
    print(json.dumps({"address": ray.get_runtime_context().gcs_address}), flush=True)
    os.dup2(2, 1)  # nobody reads the pipe from here on: what Ray prints goes to stderr
    while not stop.wait(1.0):
        pass
    _stop_everything()
    return 0


def _stop_everything() -> None:
    """ray.shutdown() (raylet first, which ends its workers; given up on after HOST_SHUTDOWN_TIMEOUT_S),
    a moment for what it signalled to exit, then SIGKILL for whatever of this session is still alive."""
    run_bounded(ray.shutdown, HOST_SHUTDOWN_TIMEOUT_S)
    session, me = os.getsid(0), os.getpid()
    deadline = time.monotonic() + 1.0
    while [p for p in session_members(session) if p != me] and time.monotonic() < deadline:
        time.sleep(0.05)
    left = kill_session(session, spare=me)
    if left:
        logger.warning("killed %d process(es) of the local Ray that outlived its shutdown", len(left))


if __name__ == "__main__":
    code = _host_main(RayHostConfig(**json.loads(sys.argv[1])))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not interpreter shutdown: Ray's exit hooks could wait on what was just killed
