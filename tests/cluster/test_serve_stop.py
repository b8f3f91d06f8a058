"""How `tandem serve --mode disaggregated` stops, as users and supervisors stop it: real subprocesses in a
session of their own, a real local Ray on 127.0.0.1, signals to the process or to its whole group.

Each test serves a request first (the workers are warm, as in the issue's measurement), then signals and
checks: the command exits with code 0 within STOP_S; every stream in flight ended, finished or with an
error that says the server is stopping (HTTP: an SSE error event; gRPC: UNAVAILABLE); and no process of
the sessions it started (serve, the RayHost and what Ray started: gcs_server, raylet, ray::* workers) is
alive. A SIGKILL of the group must leave nothing either: the RayHost stops Ray when its parent is gone.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request

import grpc

from proto import tandem_pb2, tandem_pb2_grpc
from tests.support.serve_process import session_processes, start_serve, started_sessions, wait_until_gone

STOP_S = 15.0
DISAGGREGATED = ("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1")
STOPPING = "the server is stopping"


def completion_request(http_port: int, max_tokens: int, stream: bool = False) -> urllib.request.Request:
    body = json.dumps({"prompt": [104, 105], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": stream}).encode()
    return urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", data=body,
                                  headers={"Content-Type": "application/json"})


def complete_over_http(http_port: int, max_tokens: int) -> bytes:
    return urllib.request.urlopen(completion_request(http_port, max_tokens), timeout=60).read()


def long_generation(http_port: int) -> int:
    """max_tokens that fill the served model's context after a 2-token prompt."""
    models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=30).read())
    return models["data"][0]["max_model_len"] - 2


class Streams:
    """Streams in flight on both front ends, each on a thread; `outcomes` says how each ended."""

    def __init__(self, grpc_port: int, http_port: int, max_tokens: int, each: int = 2) -> None:
        self.outcomes: list[str] = []
        self.started = threading.Semaphore(0)
        self._threads = [threading.Thread(target=self._http, args=(http_port, max_tokens), daemon=True)
                         for _ in range(each)]
        self._threads += [threading.Thread(target=self._grpc, args=(grpc_port, max_tokens), daemon=True)
                          for _ in range(each)]
        for thread in self._threads:
            thread.start()

    def wait_started(self, timeout_s: float = 60.0) -> None:
        """Until every stream has its first tokens."""
        for _ in self._threads:
            assert self.started.acquire(timeout=timeout_s), "a stream never started"

    def join(self, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), f"streams still open: {self.outcomes}"
        return self.outcomes

    def _http(self, http_port: int, max_tokens: int) -> None:
        events: list[dict] = []
        try:
            with urllib.request.urlopen(completion_request(http_port, max_tokens, stream=True), timeout=60) as response:
                for line in response:
                    if line.startswith(b"data: {"):
                        events.append(json.loads(line[6:]))
                        if len(events) == 1:
                            self.started.release()
        except Exception as error:  # noqa: BLE001 - the outcome says what went wrong
            self.outcomes.append(f"http broken: {error!r}")
            return
        last = events[-1] if events else {}
        if "error" in last:
            self.outcomes.append(f"http error: {last['error']['message']}")
        else:
            finish = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
            self.outcomes.append(f"http finished: {finish[-1] if finish else None}")

    def _grpc(self, grpc_port: int, max_tokens: int) -> None:
        request = tandem_pb2.GenerateRequest(prompt_token_ids=[104, 105], max_tokens=max_tokens,
                                             temperature=0.0, ignore_eos=True)
        finish, chunks = "", 0
        try:
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                for response in tandem_pb2_grpc.TandemStub(channel).Generate(request, timeout=60):
                    chunks += 1
                    if chunks == 1:
                        self.started.release()
                    finish = response.finish_reason or finish
        except grpc.RpcError as error:
            self.outcomes.append(f"grpc {error.code().name}: {error.details()}")
            return
        self.outcomes.append(f"grpc finished: {finish}")


def assert_ended_cleanly(outcomes: list[str]) -> None:
    """Each stream finished, or ended with an error that says the server is stopping."""
    for outcome in outcomes:
        assert outcome in ("http finished: length", "grpc finished: length") \
            or outcome in (f"http error: {STOPPING}", f"grpc UNAVAILABLE: {STOPPING}"), outcomes


def signal_and_wait(proc: subprocess.Popen, sessions: set[int], sig: int, group: bool) -> float:
    """Sends `sig` to the serve process (or its group) and returns the seconds until it exited with
    code 0; then nothing of `sessions` may be alive within STOP_S of the signal."""
    signalled = time.monotonic()
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    assert proc.wait(timeout=STOP_S) == 0
    took = time.monotonic() - signalled
    left = wait_until_gone(sessions, max(0.0, STOP_S - took))
    assert not left, f"processes outlived tandem serve: {sorted((i.pid, i.command) for i in left.values())}"
    return took


def has_processes(sessions: set[int], *names: str) -> bool:
    """Whether each of `names` is part of the command line of some process of `sessions`."""
    commands = [info.command for info in session_processes(sessions).values()]
    return all(any(name in command for command in commands) for name in names)


def test_sigterm_to_the_group_under_load_ends_every_stream_and_leaves_no_process():
    with start_serve(*DISAGGREGATED, "--shutdown-grace-s", "1") as (proc, grpc_port, http_port):
        sessions = started_sessions(proc)
        assert len(sessions) == 2, "tandem serve and its RayHost, each in a session of its own"
        complete_over_http(http_port, 4)
        assert has_processes(sessions, "raylet", "gcs_server", "ray::PrefillActor", "ray::DecodeActor")
        streams = Streams(grpc_port, http_port, long_generation(http_port))
        streams.wait_started()
        signal_and_wait(proc, sessions, signal.SIGTERM, group=True)
        outcomes = streams.join(timeout_s=5)
        assert_ended_cleanly(outcomes)
        assert any(STOPPING in outcome for outcome in outcomes), "the streams were to be in flight"
        assert "tandem: shutting down" in proc.stdout.read()


def test_sigint_to_the_process_while_idle_stops_ray_and_workers():
    with start_serve(*DISAGGREGATED) as (proc, grpc_port, http_port):
        sessions = started_sessions(proc)
        assert b'"finish_reason": "length"' in complete_over_http(http_port, 4)
        signal_and_wait(proc, sessions, signal.SIGINT, group=False)


def test_sigkill_of_the_group_leaves_no_process():
    with start_serve(*DISAGGREGATED) as (proc, grpc_port, http_port):
        sessions = started_sessions(proc)
        complete_over_http(http_port, 4)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_S)
        left = wait_until_gone(sessions, STOP_S)
        assert not left, f"processes outlived tandem serve: {sorted((i.pid, i.command) for i in left.values())}"
