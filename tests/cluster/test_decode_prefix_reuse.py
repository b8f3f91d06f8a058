"""Decoder-side prefix reuse with the bare workers (no Ray): two engines in this process, KV over real gRPC on
127.0.0.1. A chat's second turn finds the first turn's blocks (its prompt and the blocks its generated tokens
completed) in the decode worker's prefix cache: expect() pins them and reports them, the prefill worker
ships only the rest, and the decode worker admits the sequence on pinned + received blocks, with greedy
output equal to a colocated engine's. Pins are released whatever way the request ends (cancel, a transfer
that does not match them, the worker stopping); every test ends with both pools whole."""
from __future__ import annotations

import queue

import pytest

from decode_worker import DecodeChunk, DecodeEnded, DecodeStatus, DecodeWorker, DecodeWorkerConfig, ExpectedRequest
from engine import LLM, SamplingParams
from kv_transfer import TransferConfig
from prefill_worker import PrefillStatus, PrefillTask, PrefillWorker, PrefillWorkerConfig
from tests.cluster.test_workers import idle, wait_for
from tests.support.engine_checks import random_prompts

TRANSFER = TransferConfig(kv_transfer_timeout_s=10, connect_timeout_s=10)
BLOCK = 16
VOCAB = 256


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def colocated():
    return LLM("tiny", kv_cache_memory=8 << 20)


@pytest.fixture(scope="module")
def prefill():
    worker = PrefillWorker(LLM("tiny", kv_cache_memory=8 << 20).engine,
                           PrefillWorkerConfig("prefill-r", transfer=TRANSFER))
    yield worker
    worker.stop()
    assert idle(worker)


@pytest.fixture(scope="module")
def decode():
    worker = DecodeWorker(LLM("tiny", num_kv_blocks=64).engine, DecodeWorkerConfig("decode-r", transfer=TRANSFER))
    yield worker
    worker.stop()
    assert idle(worker)


def block_nbytes(worker) -> int:
    kv = worker._engine.kv_cache.kv  # [L, 2, N, block_size, H, D]
    return kv[:, :, 0].numel() * kv.element_size()


def run_turn(prefill, decode, request_id: str, prompt: list[int], max_tokens: int, cached_blocks: int | None = None):
    """expect -> prefill (shipping what the decode worker lacks) -> decode; (tokens, admission, report).
    cached_blocks: what to tell the prefill worker instead of the admission's count."""
    events: queue.Queue = queue.Queue()
    admission = decode.expect(ExpectedRequest(request_id, tuple(prompt), greedy(max_tokens)), events.put)
    assert admission.accepted, admission.reason
    skip = admission.cached_blocks if cached_blocks is None else cached_blocks
    task = PrefillTask(request_id, tuple(prompt), greedy(max_tokens), decode.address, decode_cached_blocks=skip)
    report = prefill.submit(task).result(30)
    tokens, last = [], None
    while not isinstance(last, DecodeEnded) and (last is None or last.finish_reason is None):
        last = events.get(timeout=30)
        tokens += last.token_ids if isinstance(last, DecodeChunk) else ()
    return tokens, admission, report, last


def test_a_second_turn_ships_only_what_the_decode_worker_lacks_and_equals_colocated(prefill, decode, colocated):
    first, user = random_prompts([40, 21], VOCAB, seed=31)
    tokens1, admission1, report1, _ = run_turn(prefill, decode, "turn-1", first, 12)
    assert admission1.cached_blocks == 0 and report1.kv_bytes == 3 * block_nbytes(decode)   # 40 tokens: 3 blocks
    second = first + tokens1 + user           # 73 tokens, 5 blocks
    tokens2, admission2, report2, last = run_turn(prefill, decode, "turn-2", second, 8)
    # the decode worker computed the KV of 40 + 11 tokens: 3 full blocks, the third one completed by
    # generated tokens; the transfer carries the other 2
    assert admission2.cached_blocks == 3 and report2.status is PrefillStatus.SHIPPED
    assert report2.kv_bytes == 2 * block_nbytes(decode) and last.finish_reason == "length"
    expected = colocated.generate(prompt_token_ids=[first, second], sampling_params=[greedy(12), greedy(8)],
                                  use_tqdm=False)
    assert tokens1 == expected[0].outputs[0].token_ids and tokens2 == expected[1].outputs[0].token_ids
    # the same prompt again: every full block before the last token is held; only the last block travels
    tokens3, admission3, report3, _ = run_turn(prefill, decode, "turn-2-again", second, 8)
    assert admission3.cached_blocks == (len(second) - 1) // BLOCK and report3.kv_bytes == block_nbytes(decode)
    assert tokens3 == tokens2
    wait_for(lambda: idle(prefill) and idle(decode))


def test_pins_are_released_on_cancel_and_on_a_transfer_that_does_not_match_them(prefill, decode):
    prompt = random_prompts([70], VOCAB, seed=32)[0]
    run_turn(prefill, decode, "warm", prompt, 4)   # the decode worker now holds the prompt's blocks
    engine, events = decode._engine, queue.Queue()
    free = engine.num_free_blocks
    admission = decode.expect(ExpectedRequest("pinned", tuple(prompt), greedy(4)), events.put)
    assert admission.accepted and admission.cached_blocks == 4
    assert engine.num_free_blocks == free - 5      # 4 pinned (they were free, cached) + 1 reserved
    decode.cancel("pinned")
    assert events.get(timeout=10) == DecodeEnded("pinned", DecodeStatus.CANCELLED, "cancelled")
    wait_for(lambda: idle(decode))
    # a prefill worker told fewer cached blocks than the decode worker pinned: the KV lands, admission
    # refuses the mismatch, and the received blocks, the reserved ones and the pins all go back
    _, admission, report, last = run_turn(prefill, decode, "mismatch", prompt, 4, cached_blocks=2)
    assert admission.cached_blocks == 4 and report.status is PrefillStatus.SHIPPED
    assert isinstance(last, DecodeEnded) and last.status is DecodeStatus.INVALID and "skips the first 2" in last.message
    wait_for(lambda: idle(prefill) and idle(decode))
    # a transfer that fails: 3 blocks come where 1 is reserved, and the rest of the pool was taken meanwhile
    # (as growing decodes would take it): REJECTED_NO_BLOCKS, the request ends NO_ROOM, its pins go back
    admission = decode.expect(ExpectedRequest("no-room", tuple(prompt), greedy(4)), events.put)
    assert admission.accepted and admission.cached_blocks == 4
    others = engine.reserve_blocks(engine.num_free_blocks)
    try:
        task = PrefillTask("no-room", tuple(prompt), greedy(4), decode.address, decode_cached_blocks=2)
        assert prefill.submit(task).result(30).status is PrefillStatus.TRANSFER_FAILED
        ended = events.get(timeout=10)
        assert isinstance(ended, DecodeEnded) and ended.status is DecodeStatus.NO_ROOM, ended
    finally:
        engine.free_blocks(others)
    decode.cancel("nobody")  # a command wakes the idle step thread, which refreshes stats()
    wait_for(lambda: idle(prefill) and idle(decode))


def test_a_prefill_task_claiming_more_cached_blocks_than_the_prompt_has_is_invalid(prefill, decode):
    prompt = tuple(random_prompts([33], VOCAB, seed=33)[0])  # 3 blocks: at most 2 may be cached
    report = prefill.submit(PrefillTask("over", prompt, greedy(4), decode.address, decode_cached_blocks=3)).result(10)
    assert report.status is PrefillStatus.INVALID and "decode_cached_blocks must be in [0, 2]" in report.error
    wait_for(lambda: idle(prefill))


def test_the_uncached_bound_lets_the_decode_worker_prefill_a_known_prefix_itself(prefill, decode, colocated):
    first, user = random_prompts([64, 10], VOCAB, seed=34)
    tokens1, _, _, _ = run_turn(prefill, decode, "chat-1", first, 6)
    second = first + tokens1 + user
    events: queue.Queue = queue.Queue()
    request = ExpectedRequest("chat-2", tuple(second), greedy(6), local_below_uncached_tokens=32)
    admission = decode.expect(request, events.put)
    assert admission.accepted and admission.prefill_locally and admission.cached_blocks == 4
    tokens, last = [], None
    while last is None or last.finish_reason is None:
        last = events.get(timeout=30)
        tokens += last.token_ids
    assert tokens == colocated.generate(prompt_token_ids=[second], sampling_params=greedy(6),
                                        use_tqdm=False)[0].outputs[0].token_ids
    fresh = tuple(random_prompts([40], VOCAB, seed=35)[0])    # nothing cached: 40 uncached tokens >= 32
    admission = decode.expect(ExpectedRequest("fresh", fresh, greedy(2), local_below_uncached_tokens=32), events.put)
    assert admission.accepted and not admission.prefill_locally and admission.cached_blocks == 0
    decode.cancel("fresh")
    wait_for(lambda: idle(prefill) and idle(decode))


def test_a_stopping_decode_worker_releases_the_pins_of_waiting_requests(prefill):
    worker = DecodeWorker(LLM("tiny", num_kv_blocks=32).engine, DecodeWorkerConfig("decode-s", transfer=TRANSFER))
    try:
        prompt = random_prompts([50], VOCAB, seed=36)[0]
        run_turn(prefill, worker, "warm", prompt, 2)
        events: queue.Queue = queue.Queue()
        admission = worker.expect(ExpectedRequest("left", tuple(prompt), greedy(2)), events.put)
        assert admission.accepted and admission.cached_blocks == 3
        off = DecodeWorker(LLM("tiny", num_kv_blocks=32).engine,
                           DecodeWorkerConfig("decode-off", transfer=TRANSFER, prefix_reuse=False))
        try:  # with reuse off nothing is pinned, even for a prompt the engine holds
            run_turn(prefill, off, "warm", prompt, 2)
            assert off.expect(ExpectedRequest("again", tuple(prompt), greedy(2)), queue.Queue().put).cached_blocks == 0
        finally:
            off.stop()
        assert idle(off)
    finally:
        worker.stop()
    assert events.get(timeout=5).status is DecodeStatus.SHUTDOWN
    assert idle(worker)
    wait_for(lambda: idle(prefill))
