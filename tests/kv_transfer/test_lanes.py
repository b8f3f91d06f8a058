"""KV lanes between two tensor-parallel groups of 2 ranks (kv_transfer/lanes/): real engines in this process (rank 0)
with their followers in child processes, each rank's heads going from its prefill rank straight to its decode rank
over gRPC or gloo on 127.0.0.1. The decode side's greedy tokens equal transformers (with decoder-side prefix reuse);
a cancelled request and one the decode side refuses fail on every lane and free every block on both sides; bad
input is refused before anything is taken. Every engine block is free at the end of each test."""
from __future__ import annotations

import dataclasses
import os
import threading

import pytest

from engine.builder import build_engine
from engine.config import EngineConfig
from kv_transfer import DistRendezvous, KVTransferError, ReceiveFailed, ReceiverAddress, TransferConfig
from kv_transfer import TransferStatus
from kv_transfer.engine_pool import ship_prefilled
from kv_transfer.lanes import LaneHub, LaneSender, LaneSpec
from tests.support.engine_checks import random_prompts
from tests.support.lane_pair import CONFIG, ENGINE, GREEDY, MAX_TOKENS, VOCAB, LanePair

@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))  # 4 query / 2 KV heads: one KV head per rank at TP=2


@pytest.fixture(scope="module", params=["grpc", "gloo"])
def pair(request, ckpt):
    lanes = LanePair(ckpt, request.param)
    yield lanes
    lanes.close()


def test_each_rank_ships_its_heads_and_greedy_equals_transformers_with_prefix_reuse(pair, ckpt, hf_greedy):
    prompts = random_prompts([1, 9, 30, 70], VOCAB, seed=31)
    again = prompts[3][:48] + random_prompts([11], VOCAB, seed=32)[0]  # 6 blocks the decode side holds

    def check(outcome, result):
        assert outcome.manifest.kv_heads == (0, 1)  # rank 0's lane: only its head travelled to it
        assert result.kv_bytes == 2 * len(outcome.block_ids) * pair.prefill.kv_cache.kv[:, :, 0].nbytes

    pair.greedy_with_prefix_reuse(prompts, again, hf_greedy(ckpt, prompts + [again], MAX_TOKENS), check)


def test_a_refused_and_a_cancelled_request_fail_on_every_lane_and_free_both_sides(pair):
    pair.refused_and_cancelled_end_once(random_prompts([40], VOCAB, seed=33)[0])


def test_a_lane_that_never_comes_fails_the_request_and_frees_its_blocks_once_its_wait_is_over(pair):
    """Rank 1's lane goes to a port nobody listens on: the prefill side fails it at once (gloo); the decode side has
    landed rank 0's lane and, past twice its transfer timeout, tells rank 1 to forget the request: it fails and its
    blocks go back on both sides."""
    if pair.receiver.address.transport != "gloo":
        pytest.skip("a refused gRPC connection is retried until the connect timeout")
    address = pair.receiver.address
    nowhere = dataclasses.replace(address, lanes=(address.lanes[0], "127.0.0.1:9"))
    pair.prefill_one("lost-lane", random_prompts([30], VOCAB, seed=35)[0])
    pair.receiver.timeout_s = 0.5  # the sweeper's clock (the transfers' own timeout stays)
    try:
        handle = ship_prefilled(pair.prefill, pair.sender, nowhere, "lost-lane")
        with pytest.raises(KVTransferError, match="rank 1's lane"):
            handle.result(30)
        outcome = pair.receiver.wait(30)
        assert isinstance(outcome, ReceiveFailed) and outcome.status == TransferStatus.CANCELLED, outcome
        assert "rank 1's lane: forgotten before its KV came" in outcome.message
    finally:
        pair.receiver.timeout_s = CONFIG.kv_transfer_timeout_s
    pair.assert_all_free()


def test_a_prefill_rank_killed_fails_its_lanes_and_every_block_comes_back(pair, ckpt):
    """A second prefill group whose follower is SIGKILLed after the prefill: the ship fails (rank 1's lane is gone),
    the decode side fails the request once its wait is over, and no block is left on either side."""
    if pair.receiver.address.transport != "gloo":
        pytest.skip("one transport is enough: the hub's link is the same for every one")
    config = TransferConfig(transport="gloo", kv_transfer_timeout_s=20, connect_timeout_s=30)
    hub = LaneHub()
    spec = LaneSpec("send", "gloo", config, hub.address, DistRendezvous(1, 2))
    engine = build_engine(ckpt, EngineConfig(**ENGINE), "float32", "cpu", tp_rank_service=spec)
    sender = LaneSender(engine, hub, spec)
    try:
        engine.add_request("orphan", random_prompts([25], VOCAB, seed=36)[0], GREEDY, prefill_only=True)
        while not any(d.kv_block_ids is not None for d in engine.step()):
            pass
        follower = engine.tp_leader.processes[0]
        follower.kill()
        follower.join()
        pair.receiver.timeout_s = 0.5
        handle = ship_prefilled(engine, sender, pair.receiver.address, "orphan")
        with pytest.raises(KVTransferError) as failed:
            handle.result(30)
        assert failed.value.status == TransferStatus.PEER_FAILED and "rank 1" in failed.value.message
        assert engine.num_free_blocks == engine.num_total_blocks
        outcome = pair.receiver.wait(30)
        assert isinstance(outcome, ReceiveFailed), outcome
    finally:
        pair.receiver.timeout_s = CONFIG.kv_transfer_timeout_s
        sender.close()
        engine.close()
    pair.assert_all_free()


def test_the_hubs_leave_no_socket_and_no_accepting_thread_once_every_follower_joined(pair):
    for hub in (pair.sender.hub, pair.receiver.hub):
        assert not os.path.exists(os.path.dirname(hub.address.path))
    assert not [thread for thread in threading.enumerate() if thread.name == "kv-lane-hub"]


def test_bad_input_is_refused_before_anything_is_taken(pair):
    prompt = random_prompts([20], VOCAB, seed=34)[0]
    pair.prefill_one("one-rank-peer", prompt)
    one_rank = ReceiverAddress(pair.receiver.address.transport, 0, pair.receiver.address.target)
    with pytest.raises(ValueError, match="has no KV lanes"):
        ship_prefilled(pair.prefill, pair.sender, one_rank, "one-rank-peer")  # frees the blocks it took
    with pytest.raises(ValueError, match="role"):
        LaneSpec("relay", "grpc", CONFIG, pair.sender.hub.address)
    pair.assert_all_free()


def test_a_rank_service_needs_a_tensor_parallel_engine():
    with pytest.raises(ValueError, match="tp_rank_service is for a tensor-parallel engine"):
        build_engine("tiny", EngineConfig(), "float32", "cpu", tp_rank_service=lambda context: None)
