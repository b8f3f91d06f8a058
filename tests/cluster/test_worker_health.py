"""Worker health without Ray: a step thread wedged in a step or dead makes the worker report unhealthy;
an idle worker is healthy however long it sleeps. (With Ray: tests/cluster/test_faults.py, a worker
process that hangs is found by the coordinator's health monitor and its requests migrate.)"""
from __future__ import annotations

import threading
import time

import pytest

from decode_worker import DecodeWorker, DecodeWorkerConfig, ExpectedRequest
from engine import LLM, SamplingParams
from kv_transfer import ReceiverAddress
from prefill_worker import PrefillTask, PrefillWorker, PrefillWorkerConfig
from tests.cluster.test_workers import wait_for

STALL_S = 0.3


@pytest.fixture(params=["prefill", "decode"])
def worker_and_engine(request):
    engine = LLM("tiny", kv_cache_memory=8 << 20).engine
    worker = PrefillWorker(engine, PrefillWorkerConfig("prefill-h")) if request.param == "prefill" \
        else DecodeWorker(engine, DecodeWorkerConfig("decode-h", transport="grpc"))
    yield worker, engine
    worker.stop()
    stats = worker.stats()  # the last snapshot, taken before stop() closed the engine
    assert engine.closed and stats.free_blocks == stats.total_blocks


def give_work(worker) -> None:
    """A request the worker's engine must step (a prefill task's KV goes to a closed port: it fails
    after the step, and the worker frees its blocks)."""
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    if isinstance(worker, DecodeWorker):
        worker.expect(ExpectedRequest("work", (1, 2, 3), params, prefill_locally=True), lambda event: None)
    else:
        worker.submit(PrefillTask("work", (1, 2, 3), params, ReceiverAddress("grpc", target="127.0.0.1:1")))


def finish_work(worker) -> None:
    worker.cancel("work")
    wait_for(lambda: worker.stats().engine_requests == 0 if isinstance(worker, DecodeWorker)
             else worker.stats().live_requests == 0)


def test_idle_worker_is_healthy_however_long_it_sleeps(worker_and_engine):
    worker, _ = worker_and_engine
    time.sleep(3 * STALL_S)
    assert worker.health(STALL_S).healthy


def test_a_step_that_hangs_makes_the_worker_unhealthy_until_it_returns(worker_and_engine, monkeypatch):
    worker, engine = worker_and_engine
    release, entered, real_step = threading.Event(), threading.Event(), engine.step

    def hanging_step(*observer):  # a prefill worker passes its layer-streaming observer
        entered.set()
        release.wait()
        return real_step(*observer)

    monkeypatch.setattr(engine, "step", hanging_step)
    give_work(worker)
    assert entered.wait(10)
    wait_for(lambda: not worker.health(STALL_S).healthy, timeout_s=10)
    assert "has not completed a step" in worker.health(STALL_S).reason
    release.set()
    monkeypatch.setattr(engine, "step", real_step)
    wait_for(lambda: worker.health(STALL_S).healthy, timeout_s=10)
    finish_work(worker)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_step_thread_makes_the_worker_unhealthy(worker_and_engine, monkeypatch):
    worker, engine = worker_and_engine

    def fatal_step(*observer):
        raise SystemExit("the step thread ends")  # not an Exception: nothing in the loop catches it

    monkeypatch.setattr(engine, "step", fatal_step)
    give_work(worker)
    wait_for(lambda: not worker.alive)
    assert worker.health(STALL_S) == worker.health(1e9)  # dead regardless of the timeout
    assert not worker.health(STALL_S).healthy and "died" in worker.health(STALL_S).reason
