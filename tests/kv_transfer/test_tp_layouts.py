"""KV between tensor-parallel layouts, with real engines in this process and a real gRPC pair on 127.0.0.1: a prefill
group of A ranks ships through its full-head staging pool, a decode group of B ranks lands in its own and scatters
each rank its heads (kv_transfer/group_pool.py). For (A, B) = (2, 1), (1, 2), (2, 2) the decode side's greedy tokens
equal transformers, with decoder-side prefix reuse; a delivery nobody waits for and a staging pool too full to ship
free everything (a full pool first waits for a transfer in flight to free blocks); at the end every engine block
and every staging block is free on both sides."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from engine import LLM, SamplingParams
from kv_transfer import ReceivedKV, TransferConfig, create_receiver, create_sender
from kv_transfer.engine_pool import (admit_received, drop_delivered, land_delivered, receiver_pool, sender_pool,
                                     ship_prefilled)
from kv_transfer.group_pool import GroupStaging
from tests.support.child_processes import FORKED_RANKS
from tests.support.engine_checks import assert_all_blocks_free, random_prompts

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)  # the prefill keeps the KV
VOCAB = 300
OPTIONS = dict(dtype="float32", device="cpu", block_size=8, kv_cache_memory=4 << 20, **FORKED_RANKS)


class Side:
    """One engine and its end of the gRPC link, as a worker holds them: a prefill engine's sender, or a decode
    engine's receiver; a tensor-parallel engine's staging pool (None at one rank)."""

    def __init__(self, path: str, tp: int, prefill: bool) -> None:
        self.llm = LLM(path, tensor_parallel_size=tp, **OPTIONS)
        config = TransferConfig(transport="grpc", kv_transfer_timeout_s=20, connect_timeout_s=30)
        view, self.staging = (sender_pool if prefill else receiver_pool)(self.llm.engine)
        self.link = (create_sender if prefill else create_receiver)(config, view, "grpc")

    def assert_all_free(self) -> None:
        """Every staging block and every engine block free (waiting up to 10 s for a transfer's last frees)."""
        engine, deadline = self.llm.engine, time.monotonic() + 10
        while ((self.staging is not None and self.staging.num_free != self.staging.num_blocks)
               or engine.num_free_blocks != engine.num_total_blocks) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.staging is not None:
            assert self.staging.num_free == self.staging.num_blocks, "a staging block leaked"
        assert_all_blocks_free(self.llm)

    def close(self) -> None:
        try:
            self.link.close()
            self.assert_all_free()
        finally:
            self.llm.close()


class Pair:
    """A prefill engine and a decode engine joined by a gRPC sender and receiver, as the workers join them."""

    def __init__(self, prefill: Side, decode: Side) -> None:
        self.sides = (prefill, decode)
        self.prefill, self.decode = prefill.llm, decode.llm
        self.sender, self.receiver = prefill.link, decode.link
        self.send_staging, self.receive_staging = prefill.staging, decode.staging

    def prefill_one(self, rid: str, prompt: list[int]) -> None:
        engine = self.prefill.engine
        engine.add_request(rid, prompt, FIRST, prefill_only=True)
        while not any(d.kv_block_ids is not None and d.request_id == rid for d in engine.step()):
            pass

    def ship(self, rid: str, prefix_blocks: int = 0):
        return ship_prefilled(self.prefill.engine, self.sender, self.receiver.address, rid,
                              prefix_blocks=prefix_blocks, staging=self.send_staging)

    def receive(self) -> ReceivedKV:
        outcome = self.receiver.wait(30)
        assert isinstance(outcome, ReceivedKV), outcome
        return outcome

    def decode_all(self, admitted: dict[str, tuple]) -> dict[str, list[int]]:
        """Admit each (outcome, prompt, cached blocks) and decode them all; their tokens, first included."""
        engine, tokens = self.decode.engine, {}
        for rid, (outcome, prompt, cached) in admitted.items():
            delta = admit_received(engine, land_delivered(outcome, self.receive_staging), prompt, GREEDY,
                                   cached_block_ids=cached)
            tokens[rid] = list(delta.new_token_ids)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens[delta.request_id] += delta.new_token_ids
        return tokens

    def assert_all_free(self) -> None:
        """Both sides: every engine block and every staging block free."""
        for side in self.sides:
            side.assert_all_free()


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))  # 4 query / 2 KV heads: one KV head per rank at TP=2


@pytest.fixture(scope="module")
def pairs(ckpt):
    """`get(prefill_tp, decode_tp) -> Pair`: the module's tests share their engines (one prefill and one decode
    engine per size, each started once with its sender or receiver). A Pair starts with both prefix caches empty,
    as fresh engines; each test checks at its end that every block is free. Closed at the module's end."""
    sides: dict[tuple[bool, int], Side] = {}

    def side(prefill: bool, tp: int) -> Side:
        if (prefill, tp) not in sides:
            sides[prefill, tp] = Side(ckpt, tp, prefill)
        return sides[prefill, tp]

    def get(prefill_tp: int, decode_tp: int) -> Pair:
        pair = Pair(side(True, prefill_tp), side(False, decode_tp))
        for llm in (pair.prefill, pair.decode):
            llm.engine.kv_cache.allocator.reset_prefix_cache()
        return pair

    yield get
    errors = []
    for one in sides.values():
        try:
            one.close()
        except AssertionError as error:  # every side is closed; the first leak is reported
            errors.append(error)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (2, 2)])
def test_greedy_across_layouts_equals_transformers_with_prefix_reuse(prefill_tp, decode_tp, ckpt, hf_greedy,
                                                                    pairs):
    prompts = random_prompts([1, 9, 30, 70], VOCAB, seed=21)
    again = prompts[3][:48] + random_prompts([11], VOCAB, seed=22)[0]  # 6 blocks the decode side holds
    expected = hf_greedy(ckpt, prompts + [again], MAX_TOKENS)
    pair = pairs(prefill_tp, decode_tp)
    admitted = {}
    for i, prompt in enumerate(prompts):
        pair.prefill_one(f"r{i}", prompt)
        handle = pair.ship(f"r{i}")
        admitted[f"r{i}"] = (pair.receive(), prompt, ())
        handle.result(30)  # raises if the transfer failed
    tokens = pair.decode_all(admitted)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected[:4]
    cached = pair.decode.engine.pin_cached_prefix(again)  # the decode side's prefix cache holds r3's blocks
    assert len(cached) == 6
    pair.prefill_one("again", again)
    handle = pair.ship("again", prefix_blocks=len(cached))
    outcome = pair.receive()
    assert outcome.manifest.prefix_blocks == 6 and len(outcome.block_ids) == 2
    handle.result(30)
    assert pair.decode_all({"again": (outcome, again, cached)})["again"] == expected[4]
    pair.assert_all_free()


def test_a_delivery_nobody_waits_for_and_a_full_staging_pool_free_everything(pairs):
    pair = pairs(2, 2)
    prompt = random_prompts([40], VOCAB, seed=23)[0]
    pair.prefill_one("dropped", prompt)
    handle = pair.ship("dropped")
    outcome = pair.receive()
    assert pair.receive_staging.num_free < pair.receive_staging.kv.shape[2]
    drop_delivered(pair.decode.engine, outcome, pair.receive_staging)
    handle.result(30)
    staging: GroupStaging = pair.send_staging
    held = staging.allocate(staging.num_free - 2)  # 2 staging blocks left, 5 needed
    pair.prefill_one("no-room", prompt)
    staging.wait_s = 0.2
    with pytest.raises(ValueError, match="staging pool has 2 free blocks, 5 needed"):
        pair.ship("no-room")
    pair.prefill_one("waits", prompt)  # a transfer in flight frees 3 blocks while the next waits for them
    staging.wait_s = 20.0
    threading.Timer(0.3, staging.free, [held[:3]]).start()
    handle = pair.ship("waits")
    drop_delivered(pair.decode.engine, pair.receive(), pair.receive_staging)
    handle.result(30)
    staging.free(held[3:])
    deadline = time.monotonic() + 10
    while pair.prefill.engine.num_free_blocks != pair.prefill.engine.num_total_blocks:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pair.assert_all_free()


@pytest.mark.parametrize("arch,size", [("llama", 2), ("llama3", 4)])  # llama3 at 4: 2 KV heads, each on 2 ranks
def test_staging_round_trip_is_bit_exact_with_the_gather_and_scatter_of_full_tensors(arch, size, tiny_checkpoint):
    """stage_out gathers into staging blocks, land scatters from them (consecutive runs and scattered blocks):
    each equal to gather_kv_heads / scatter_kv_heads of a full-head tensor, bit for bit; every block free after."""
    with LLM(str(tiny_checkpoint(arch)), tensor_parallel_size=size, **OPTIONS) as group:
        engine, leader = group.engine, group.engine.tp_leader
        staging, kv = GroupStaging(engine, num_blocks=8), engine.kv_cache.kv
        full = torch.randn(kv.shape[0], 2, 3, kv.shape[3], engine.model_config.num_kv_heads, kv.shape[5])
        blocks = engine.reserve_blocks(3)
        leader.scatter_kv_heads(blocks, full)  # every rank its heads, from a full tensor
        staged = staging.stage_out(blocks)  # frees the engine blocks
        assert staged == [0, 1, 2] and torch.equal(staging.kv[:, :, staged], full)
        held = staging.allocate(5)
        staging.free(staged)  # handed out again as one run: [0, 1, 2], after the blocks freed last
        staging.free([held[3], held[0], held[2]])  # [6, 3, 5]: no run
        view = staging.receiver_view()
        deliveries = [view.allocate(3), view.allocate(3)]  # each block paired with an engine block
        assert deliveries == [[6, 3, 5], [0, 1, 2]]
        for landed in deliveries:
            staging.kv[:, :, landed] = full.flip(2)
            engine_blocks = list(staging.land(ReceivedKV(None, tuple(landed), 0, 0.0)).block_ids)
            assert torch.equal(leader.gather_kv_heads(engine_blocks), full.flip(2))  # every rank's, bit for bit
            engine.free_blocks(engine_blocks)
        staging.free([held[1], held[4]])
        assert staging.num_free == staging.num_blocks
        assert_all_blocks_free(group)
