"""KV lanes between groups of different sizes (kv_transfer/lanes/parts.py, assembly.py): a prefill group of 2 ranks
merging its heads into a one-rank decode engine over gloo, and a one-rank prefill engine splitting its heads over a
decode group of 2 ranks over gRPC, real engines in this process (followers in child processes). The decode side's
greedy tokens equal transformers, with decoder-side prefix reuse; a refused and a cancelled request fail every part
and end once on the decode side; every block on both sides is free at the end. (The tiny Llama checkpoint: 2 KV
heads, one per rank at TP=2.)"""
from __future__ import annotations

import pytest

from kv_transfer import KVTransferError, ReceiveFailed, TransferStatus
from kv_transfer.lanes.parts import LanePart
from tests.support.engine_checks import random_prompts
from tests.support.lane_pair import MAX_TOKENS, VOCAB, LanePair

LAYOUTS = {  # (transport, prefill TP, decode TP) -> the parts of every transfer
    ("gloo", 2, 1): (LanePart(0, 0, (0, 1)), LanePart(1, 0, (1, 2))),
    ("grpc", 1, 2): (LanePart(0, 0, (0, 1)), LanePart(0, 1, (1, 2))),
}


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=["gloo-2to1", "grpc-1to2"])
def pair(request, ckpt):
    transport, prefill_tp, decode_tp = request.param
    lanes = LanePair(ckpt, transport, prefill_tp, decode_tp)
    lanes.layout = request.param
    yield lanes
    lanes.close()


def test_the_heads_merge_or_split_and_greedy_equals_transformers_with_prefix_reuse(pair, ckpt, hf_greedy):
    address = pair.receiver.address
    assert address.lane_heads == ((0, 2),) if pair.layout[2] == 1 else ((0, 1), (1, 2))
    assert pair.sender.reaches(address) and pair.sender.plan(address) == LAYOUTS[pair.layout]
    prompts = random_prompts([1, 9, 30, 70], VOCAB, seed=51)
    again = prompts[3][:48] + random_prompts([11], VOCAB, seed=52)[0]  # 6 blocks the decode side holds

    def check(outcome, result):
        every_head = len(outcome.block_ids) * pair.decode.kv_cache.kv[:, :, 0].nbytes * pair.layout[2]
        assert result.kv_bytes == every_head

    pair.greedy_with_prefix_reuse(prompts, again, hf_greedy(ckpt, prompts + [again], MAX_TOKENS), check)
    assert pair.sender.delivered == 5


def test_a_refused_and_a_cancelled_request_fail_every_part_and_end_once(pair):
    pair.refused_and_cancelled_end_once(random_prompts([40], VOCAB, seed=53)[0])


def test_a_prefill_rank_killed_leaves_half_a_request_that_the_decode_side_drops_once_its_wait_is_over(pair):
    """Last in the module (the prefill group loses a rank). Rank 1's part never leaves: the ship fails at once, rank
    0's part lands in half of the decode rank's heads, and past twice the transfer timeout the decode side drops the
    request, its blocks free."""
    if pair.layout[1] != 2:
        pytest.skip("a prefill group of 2 ranks merging into one")
    pair.prefill_one("orphan", random_prompts([25], VOCAB, seed=54)[0])
    follower = pair.prefill.tp_leader.processes[0]
    follower.kill()
    follower.join()
    pair.receiver.timeout_s = 0.5  # the sweeper's clock
    handle = pair.ship("orphan")
    with pytest.raises(KVTransferError) as failed:
        handle.result(30)
    assert failed.value.status == TransferStatus.PEER_FAILED and "rank 1" in failed.value.message
    outcome = pair.receiver.wait(30)
    assert isinstance(outcome, ReceiveFailed) and outcome.status == TransferStatus.CANCELLED, outcome
    assert pair.receiver.wait(0.5) is None
    pair.assert_all_free()
