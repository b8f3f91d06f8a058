"""The prefill and decode workers without Ray (they must run bare): two engines in this process, KV over
real gRPC on 127.0.0.1. Backpressure, timeouts, cancels, rejected input, deliveries nobody expects, and
the per-peer transfer slots; every test ends with both pools empty."""
from __future__ import annotations

import queue
import time

import pytest

from decode_worker import DecodeEnded, DecodeStatus, DecodeWorker, DecodeWorkerConfig, ExpectedRequest
from engine import LLM, SamplingParams
from kv_transfer import TransferConfig
from prefill_worker import PrefillStatus, PrefillTask, PrefillWorker, PrefillWorkerConfig
from tests.support.cluster_rig import is_idle
from tests.support.engine_checks import random_prompts

TRANSFER = TransferConfig(kv_transfer_timeout_s=10, connect_timeout_s=10)
DECODE_BLOCKS = 8  # block size 16: 128 tokens
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def idle(worker) -> bool:
    """No request and no block held (a tensor-parallel worker's staging pool whole too)."""
    return is_idle(worker.stats())


@pytest.fixture(scope="module")
def prefill():
    worker = PrefillWorker(LLM("tiny", kv_cache_memory=8 << 20).engine,
                           PrefillWorkerConfig("prefill-t", transfer=TRANSFER, max_transfers_per_peer=1))
    yield worker
    worker.stop()
    assert idle(worker)


@pytest.fixture(scope="module")
def decode():
    worker = DecodeWorker(LLM("tiny", num_kv_blocks=DECODE_BLOCKS).engine,
                          DecodeWorkerConfig("decode-t", transfer=TRANSFER, max_live_requests=3, expect_timeout_s=0.3))
    yield worker
    worker.stop()
    assert idle(worker)


def test_decode_worker_refuses_when_its_pool_is_reserved_and_waits_for_a_transfer_to_start(decode):
    """A request whose KV has not started to come waits past expect_timeout_s (its prefill may sit in a
    long queue; the coordinator cancels it if it gives up); its blocks stay reserved meanwhile."""
    events: queue.Queue = queue.Queue()
    prompts = random_prompts([100, 20], 256, seed=1)
    assert decode.expect(ExpectedRequest("big", tuple(prompts[0]), GREEDY), events.put).accepted
    refused = decode.expect(ExpectedRequest("small", tuple(prompts[1]), GREEDY), events.put)
    assert not refused.accepted and "KV pool full" in refused.reason
    time.sleep(3 * decode._config.expect_timeout_s)
    assert events.empty() and decode.stats().waiting == 1   # still waiting: no transfer started
    decode.cancel("big")
    assert events.get(timeout=5) == DecodeEnded("big", DecodeStatus.CANCELLED, "cancelled")
    assert decode.expect(ExpectedRequest("small", tuple(prompts[1]), GREEDY), events.put).accepted
    decode.cancel("small")
    assert events.get(timeout=5) == DecodeEnded("small", DecodeStatus.CANCELLED, "cancelled")
    wait_for(lambda: idle(decode))


def test_cancel_that_overtakes_its_expect_still_cancels_it(decode):
    """Ray may run an actor's cancel() before the stream call whose expect() it follows."""
    events: queue.Queue = queue.Queue()
    decode.cancel("early")
    assert decode.expect(ExpectedRequest("early", (1, 2, 3), GREEDY), events.put).accepted
    ended = events.get(timeout=5)
    assert isinstance(ended, DecodeEnded) and ended.status is DecodeStatus.CANCELLED, ended
    wait_for(lambda: idle(decode))


def test_decode_worker_refuses_past_its_live_request_limit(decode):
    events: queue.Queue = queue.Queue()
    accepted = [decode.expect(ExpectedRequest(f"n{i}", (1, 2), GREEDY), events.put).accepted for i in range(4)]
    assert accepted == [True, True, True, False]
    for i in range(3):
        decode.cancel(f"n{i}")
    wait_for(lambda: idle(decode))


def test_prefill_worker_rejects_bad_input_and_cancels_queued_work(prefill, decode):
    bad = prefill.submit(PrefillTask("bad", (1, 99_999), GREEDY, decode.address)).result(10)
    assert bad.status is PrefillStatus.INVALID and "vocabulary" in bad.error
    long_prompt = tuple(random_prompts([1500], 256, seed=2)[0])
    queued = [prefill.submit(PrefillTask(f"q{i}", long_prompt, GREEDY, decode.address)) for i in range(3)]
    for i in range(3):
        prefill.cancel(f"q{i}")
    statuses = [future.result(10).status for future in queued]
    assert statuses.count(PrefillStatus.CANCELLED) >= 2  # the first may already be on the wire
    wait_for(lambda: idle(prefill) and idle(decode))


def test_deliveries_nobody_expects_are_freed_and_slots_pass_in_order(prefill, decode):
    prompts = random_prompts([40, 17, 33, 5], 256, seed=3)
    futures = [prefill.submit(PrefillTask(f"u{i}", tuple(p), GREEDY, decode.address)) for i, p in enumerate(prompts)]
    reports = [future.result(20) for future in futures]
    assert [r.status for r in reports] == [PrefillStatus.SHIPPED] * 4 and all(r.kv_bytes > 0 for r in reports)
    wait_for(lambda: idle(prefill) and idle(decode))


def test_an_accepted_requests_blocks_are_reserved_until_its_kv_lands(prefill, decode):
    """expect() takes the prompt's blocks out of the pool at once: when everything else in the pool is
    gone (here taken directly, as growing decodes would take it) the KV still lands, in those blocks."""
    events: queue.Queue = queue.Queue()
    prompt = tuple(random_prompts([28], 256, seed=4)[0])  # 2 blocks; 28 + 4 tokens still fit in them
    engine = decode._engine
    free_before = engine.num_free_blocks
    assert decode.expect(ExpectedRequest("kept", prompt, GREEDY), events.put).accepted
    assert engine.num_free_blocks == free_before - 2
    wait_for(lambda: decode.stats().promised_blocks == 2)
    others = engine.reserve_blocks(engine.num_free_blocks)   # the rest of the pool is taken
    try:
        report = prefill.submit(PrefillTask("kept", prompt, GREEDY, decode.address)).result(20)
        assert report.status is PrefillStatus.SHIPPED
        tokens, last = [], None
        while last is None or not (isinstance(last, DecodeEnded) or last.finish_reason):
            last = events.get(timeout=10)
            tokens += getattr(last, "token_ids", ())
        assert not isinstance(last, DecodeEnded), last
        assert len(tokens) == GREEDY.max_tokens and last.finish_reason == "length"
    finally:
        engine.free_blocks(others)
        decode.cancel("nobody")  # a command wakes the idle step thread, which refreshes stats()
    wait_for(lambda: idle(prefill) and idle(decode))
