"""The worker actors' control calls (info, stats, cancel) run in their own concurrency group, so they answer
while prefill calls fill the default group and more wait in Ray's queue behind them; a cancel that
overtakes its prefill call is kept (PrefillCalls) so that the call ends at once when it comes.

On a real local Ray: one PrefillActor whose default group runs 2 calls at once, 8 prefill calls whose KV
goes to a receiver that never answers (each holds its slot for ~2 * HOLD_S), and control calls that must
answer within ANSWER_S, far less than the queue in front of them takes (4 rounds of ~2 * HOLD_S). No timing
is asserted beyond "answered at all before the queue drained".
"""
from __future__ import annotations

import os
import signal
import socket
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import ray

from cluster.workers.actors import EngineSpec, PrefillActor, PrefillCalls
from kv_transfer import TransferConfig
from kv_transfer.config import ReceiverAddress
from prefill_worker import PrefillTask, PrefillWorkerConfig
from tests.support.cluster_rig import SMALL_ENGINE, greedy, start_local_ray

HOLD_S = 20.0        # a transfer to the stalled receiver ends after 2 * HOLD_S
ANSWER_S = 15.0      # what a control call gets, against at least 4 * 2 * HOLD_S of queue
CALLS = 8


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray()


@pytest.fixture
def stalled_receiver():
    """A loopback port that takes TCP connections and never answers: a KV receiver that hangs."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    yield ReceiverAddress("grpc", target=f"127.0.0.1:{listener.getsockname()[1]}")
    listener.close()


@pytest.fixture
def busy_prefill_actor(local_ray):
    """A PrefillActor running at most 2 calls of its default group at once; killed (and its process
    checked gone, by pid) at the end."""
    transfer = TransferConfig(kv_transfer_timeout_s=HOLD_S, connect_timeout_s=HOLD_S)
    config = PrefillWorkerConfig("prefill-busy", "grpc", transfer, max_transfers_per_peer=CALLS)
    actor = PrefillActor.options(max_concurrency=2, num_cpus=1).remote(
        EngineSpec("tiny", "float32", "cpu", SMALL_ENGINE, 1), config)
    info = ray.get(actor.info.remote(), timeout=120)
    yield actor
    ray.kill(actor)
    _wait_gone(info.pid)


def _wait_gone(pid: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_control_calls_answer_while_prefill_calls_queue(busy_prefill_actor, stalled_receiver):
    actor = busy_prefill_actor
    prompt = tuple(range(1, 33))
    refs = [actor.prefill.remote(PrefillTask(f"busy-{i}", prompt, greedy(4), stalled_receiver))
            for i in range(CALLS)]
    deadline = time.monotonic() + 60
    while (stats := ray.get(actor.stats.remote(), timeout=ANSWER_S)).live_requests < 2:
        assert time.monotonic() < deadline, f"the prefill calls never started: {stats}"
        time.sleep(0.2)
    assert stats.live_requests == 2, "the default group runs 2 calls; the others wait in Ray's queue"
    assert ray.get(actor.cancel.remote(f"busy-{CALLS - 1}"), timeout=ANSWER_S) is None  # queued: kept
    assert ray.get(actor.cancel.remote("busy-0"), timeout=ANSWER_S) is None  # on the wire: its transfer stops
    assert ray.get(actor.info.remote(), timeout=ANSWER_S).name == "prefill-busy"
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    assert not set(ready) - {refs[0]}, "the control calls were to answer before the prefill queue drained"


class _RecordingWorker:
    """The PrefillWorker calls PrefillCalls makes, recorded; futures resolved by the test."""

    def __init__(self) -> None:
        self.submitted: dict[str, Future] = {}
        self.cancelled: list[str] = []

    def submit(self, task: PrefillTask) -> Future:
        self.submitted[task.request_id] = Future()
        return self.submitted[task.request_id]

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


def test_a_cancel_that_overtakes_its_prefill_call_ends_that_call():
    worker = _RecordingWorker()
    calls = PrefillCalls(worker)
    address = ReceiverAddress("grpc", target="127.0.0.1:1")
    task = lambda rid: PrefillTask(rid, (1, 2, 3), greedy(2), address)  # noqa: E731

    calls.cancel("early")                              # before its call: nothing to cancel yet, kept
    assert calls.submit(task("early")) is None         # the call ends at once, nothing submitted
    assert "early" not in worker.submitted and worker.cancelled == []
    assert calls.submit(task("early")) is not None     # a cancel is used once

    running = calls.submit(task("running"))
    calls.cancel("running")                            # while it runs: passed on to the worker
    assert worker.cancelled == ["running"]
    running.set_result(None)
    calls.cancel("running")                            # after it ended: kept (and forgotten later), harmless
    assert worker.cancelled == ["running"]
