"""The prefill and decode workers (bare, no Ray) with layer-wise KV streaming over gloo and gRPC: greedy
tokens equal transformers', the transfer starts before the prefill step ends (layer mode) or after it
(request mode), a first token that ends the request aborts its stream, and both pools end whole. Also between
tensor-parallel groups (2 ranks each: a prefill group streams each layer gathered to its rank 0's staging pool,
kv_transfer/group_pool.py; a decode group lands the streamed layers in its own) and from a group to one rank; and
between groups of 2 ranks with KV lanes, each rank streaming its own heads to its rank (kv_transfer/lanes/)."""
from __future__ import annotations

import queue

import pytest

from decode_worker import DecodeEnded, DecodeWorker, DecodeWorkerConfig, ExpectedRequest
from engine import SamplingParams
from engine.builder import build_engine
from engine.config import EngineConfig
from kv_transfer import DistRendezvous, TransferConfig
from kv_transfer.lanes import GroupLanes
from prefill_worker import PrefillStatus, PrefillTask, PrefillWorker, PrefillWorkerConfig
from tests.cluster.test_workers import idle, wait_for
from tests.support.engine_checks import random_prompts

TRANSFER = TransferConfig(kv_transfer_timeout_s=20, connect_timeout_s=20, dist_lanes=2)
MAX_TOKENS = 5
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = [7, 40, 90, 23]  # 90 > the 64-token budget: chunked over two steps


def _workers(path: str, transport: str, streaming: str, prefill_tp: int = 1, decode_tp: int = 1, lanes: str = ""):
    def engine(tp: int, group_lanes: GroupLanes | None):
        config = EngineConfig(tensor_parallel_size=tp, kv_cache_memory=8 << 20, max_num_batched_tokens=64,
                              enable_chunked_prefill=True)
        return build_engine(path, config, device="cpu", tp_rank_service=group_lanes and group_lanes.spec)

    prefill_rdzv = decode_rdzv = None
    if transport == "gloo":
        prefill_rdzv = DistRendezvous(0, 2, f"stream-{streaming}")
        decode_rdzv = DistRendezvous(1, 2, f"stream-{streaming}")
    decode_lanes = GroupLanes.open("receive", transport, TRANSFER, decode_rdzv, (0,)) if lanes else None
    decode = DecodeWorker(engine(decode_tp, decode_lanes), DecodeWorkerConfig(
        f"decode-{streaming}", transport=transport, transfer=TRANSFER, rendezvous=decode_rdzv, peer_ranks=(0,)),
        lanes=decode_lanes)
    prefill_lanes = GroupLanes.open("send", transport, TRANSFER, prefill_rdzv) if lanes else None
    prefill = PrefillWorker(engine(prefill_tp, prefill_lanes), PrefillWorkerConfig(
        f"prefill-{streaming}", transport=transport, transfer=TRANSFER, rendezvous=prefill_rdzv,
        kv_streaming=streaming), prefill_lanes)
    return prefill, decode


@pytest.fixture(scope="module", params=[("gloo", "layer"), ("grpc", "layer"), ("gloo", "request"),
                                        ("grpc", "layer", 2, 2), ("gloo", "layer", 2, 1),
                                        ("gloo", "layer", 2, 2, "lanes")],
                ids=lambda p: "-".join(map(str, p)))
def workers(request, tiny_checkpoint):
    transport, streaming, *tp = request.param
    path = str(tiny_checkpoint("llama"))
    prefill, decode = _workers(path, transport, streaming, *tp)
    assert prefill.stats().lane_transfers == 0
    yield path, streaming, prefill, decode
    prefill.stop()
    decode.stop()
    assert idle(prefill) and idle(decode)


def _generate(prefill, decode, prompts, params, prefix: str):
    """Expect on the decode worker, prefill all at once (packed in shared steps); tokens and reports."""
    events = {i: queue.Queue() for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        assert decode.expect(ExpectedRequest(f"{prefix}{i}", tuple(prompt), params), events[i].put).accepted
    futures = [prefill.submit(PrefillTask(f"{prefix}{i}", tuple(p), params, decode.address))
               for i, p in enumerate(prompts)]
    reports = [future.result(30) for future in futures]
    return reports, events


def _tokens(events: queue.Queue) -> list[int]:
    tokens, last = [], None
    while last is None or not (isinstance(last, DecodeEnded) or last.finish_reason):
        last = events.get(timeout=20)
        tokens += getattr(last, "token_ids", ())
    assert not isinstance(last, DecodeEnded), last
    return tokens


def test_greedy_tokens_equal_transformers_and_the_transfer_overlaps_the_step(workers, hf_greedy):
    path, streaming, prefill, decode = workers
    prompts = random_prompts(PROMPT_LENGTHS, 256, seed=21)
    reports, events = _generate(prefill, decode, prompts, GREEDY, "g")
    assert [r.status for r in reports] == [PrefillStatus.SHIPPED] * len(prompts), reports
    assert [_tokens(events[i]) for i in range(len(prompts))] == hf_greedy(path, prompts, MAX_TOKENS)
    lanes = len(decode.address.lanes) == 2  # the lanes variant: every transfer went by them
    wait_for(lambda: prefill.stats().lane_transfers == (len(prompts) if lanes else 0))
    for report in reports:
        assert report.kv_bytes > 0 and report.transfer_exposed_ms >= 0
        if streaming == "layer":  # sent from before the last step's forward ended
            assert report.forward_ended is not None and report.transfer_started < report.forward_ended
            assert report.transfer_exposed_ms <= report.transfer_ms
        else:
            assert report.forward_ended is None and report.transfer_started >= report.prefill_ended
    wait_for(lambda: idle(prefill) and idle(decode))


def test_a_first_token_that_ends_the_request_aborts_its_stream(workers):
    _, _, prefill, decode = workers
    prompts = random_prompts([12, 30], 256, seed=22)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    reports, _ = _generate(prefill, decode, prompts, one, "one")
    assert [r.status for r in reports] == [PrefillStatus.FINISHED] * 2, reports
    for i in range(len(prompts)):  # the coordinator cancels the expectation of a request that ended
        decode.cancel(f"one{i}")
    wait_for(lambda: idle(prefill) and idle(decode))
