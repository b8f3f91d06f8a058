"""Disaggregated prefill/decode with real engines: prefill_only on an engine in a spawned process (A),
KV over real gloo or gRPC on 127.0.0.1 (runs as pool planes), decode on an engine in the pytest process (B).

B's greedy tokens must equal a colocated LLM.generate of the same prompts, token for token; B's blocks
must hold A's prompt KV bit for bit; every block is free on both sides at the end.
"""
from __future__ import annotations

import time
from typing import Callable

import pytest

from engine import LLM, SamplingParams
from kv_transfer import DistRendezvous, KVReceiver, ReceivedKV, TransferConfig, create_receiver
from kv_transfer.engine_pool import admit_received, engine_pool_view, take_prefilled
from tests.support.engine_checks import random_prompts
from tests.support.engines import make_llm
from tests.support.kv_engine_peer import (AwaitShipped, PoolState, Prefill, PrefillPeerProcess, PrefillPeerSpec, Ship,
                                          prompt_kv_digest)

BLOCK_SIZE = 8
PREFILL_BLOCKS = 128   # A hands out ids < 128; B holds its ids < 128, so the two sides' ids differ
DECODE_BLOCKS = 320
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
VOCAB = 300


def prompt_waves(seed: int) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Wave 1: 1 token, exactly one block, one block + 1 token, a few blocks, 25 blocks. Wave 2 shares
    prefixes with wave 1, so A serves it partly from its prefix cache."""
    lengths = {"one-token": 1, "one-block": BLOCK_SIZE, "block-plus-one": BLOCK_SIZE + 1, "few": 23, "long": 200}
    drawn = random_prompts(list(lengths.values()) + [13, 3, 30], VOCAB, seed=seed)
    wave1 = dict(zip(lengths, drawn))
    long, short = wave1["long"], wave1["block-plus-one"]
    wave2 = {"long-again": list(long), "long-prefix": long[:160] + drawn[5],
             "short-prefix": short[:BLOCK_SIZE] + drawn[6], "fresh": drawn[7]}
    return wave1, wave2


EXPECTED_CACHED_TOKENS = {"long-again": 192, "long-prefix": 160, "short-prefix": BLOCK_SIZE, "fresh": 0}


class DecodeLoop:
    """B's step loop, as a decode worker runs it: admit deliveries, step, collect tokens."""

    def __init__(self, engine, receiver: KVReceiver, prompts: dict[str, list[int]]):
        self.engine, self.receiver, self.prompts = engine, receiver, prompts
        self.tokens: dict[str, list[int]] = {}
        self.digests: dict[str, str] = {}
        self.received: dict[str, ReceivedKV] = {}
        self.finished: set[str] = set()

    def run(self, until: Callable[[], bool], timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, f"decode side stuck: admitted {sorted(self.received)}"
            for outcome in self.receiver.poll():
                self.admit(outcome)
            if self.engine.has_unfinished_requests():
                self.record(self.engine.step())
            elif (outcome := self.receiver.wait(0.05)) is not None:
                self.admit(outcome)

    def admit(self, outcome) -> None:
        assert isinstance(outcome, ReceivedKV), f"transfer failed: {outcome}"
        rid, num_tokens = outcome.request_id, outcome.manifest.num_tokens
        self.received[rid] = outcome
        self.digests[rid] = prompt_kv_digest(self.engine.kv_cache.kv, outcome.block_ids, num_tokens)
        self.tokens[rid] = []
        self.record([admit_received(self.engine, outcome, self.prompts[rid], GREEDY)])

    def record(self, deltas) -> None:
        for delta in deltas:
            self.tokens[delta.request_id] += delta.new_token_ids
            if delta.finish_reason is not None:
                self.finished.add(delta.request_id)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def prefill_peer(ckpt):
    peer = PrefillPeerProcess(PrefillPeerSpec(ckpt, BLOCK_SIZE, PREFILL_BLOCKS))
    yield peer
    peer.stop()


@pytest.fixture(scope="module")
def colocated(ckpt) -> LLM:
    with make_llm(ckpt, block_size=BLOCK_SIZE) as llm:
        yield llm


@pytest.fixture
def decode_engine(ckpt):
    engine = make_llm(ckpt, block_size=BLOCK_SIZE, num_kv_blocks=DECODE_BLOCKS).engine
    # B holds the ids A hands out (< PREFILL_BLOCKS) whatever order its free list is in (a warm-up on a GPU
    # reorders it): take every block, give back the others
    every_block = engine.reserve_blocks(engine.num_free_blocks)
    engine.free_blocks([block for block in every_block if block >= PREFILL_BLOCKS])
    held = sorted(block for block in every_block if block < PREFILL_BLOCKS)
    assert held == list(range(PREFILL_BLOCKS))
    yield engine
    engine.free_blocks(held)
    assert engine.num_live_requests == 0, "requests still live on the decode side"
    assert engine.num_free_blocks == engine.num_total_blocks, "decode side leaks KV blocks"


def make_receiver(transport: str, engine) -> KVReceiver:
    config = TransferConfig(transport=transport, kv_transfer_timeout_s=20, connect_timeout_s=30)
    rdzv = DistRendezvous(rank=0, world_size=2, namespace=f"engines-{transport}")
    return create_receiver(config, engine_pool_view(engine), transport, rendezvous=rdzv, peers=[1])


def as_command(prompts: dict[str, list[int]]) -> Prefill:
    return Prefill(tuple((rid, tuple(p)) for rid, p in prompts.items()), MAX_TOKENS)


def assert_prefill_side_free(peer: PrefillPeerProcess) -> None:
    state = peer.call(PoolState())
    assert state["live"] == 0 and state["free"] == state["total"], f"prefill side leaks: {state}"


@pytest.mark.parametrize("transport, seed", [("gloo", 11), ("grpc", 12)])
def test_decode_engine_continues_prefill_engine(transport, seed, prefill_peer, colocated, decode_engine):
    wave1, wave2 = prompt_waves(seed)
    prompts = {**wave1, **wave2}
    outs = colocated.generate(prompt_token_ids=list(prompts.values()), sampling_params=GREEDY, use_tqdm=False)
    expected = {rid: out.outputs[0].token_ids for rid, out in zip(prompts, outs)}
    receiver = make_receiver(transport, decode_engine)
    loop = DecodeLoop(decode_engine, receiver, prompts)
    namespace = f"engines-{transport}"
    try:
        prefilled = {p.request_id: p for p in prefill_peer.call(as_command(wave1))}
        prefill_peer.call(Ship(tuple(wave1), receiver.address, namespace))   # five transfers in flight at once
        prefill_peer.post(as_command(wave2))          # A prefills wave 2 while B admits and decodes wave 1
        loop.run(until=lambda: set(wave1) <= set(loop.received))
        prefilled.update({p.request_id: p for p in prefill_peer.reply()})
        prefill_peer.call(Ship(tuple(wave2), receiver.address, namespace))
        loop.run(until=lambda: loop.finished == set(prompts))
        shipped = prefill_peer.call(AwaitShipped(tuple(prompts)))
    finally:
        receiver.close()
    assert shipped == {rid: "OK" for rid in prompts}
    assert receiver.poll() == [], "the receiver delivered something unexpected"
    for rid, prompt in prompts.items():
        got, sent = loop.received[rid], prefilled[rid]
        assert got.manifest.block_ids == sent.block_ids and got.manifest.num_tokens == len(prompt)
        assert set(got.block_ids).isdisjoint(sent.block_ids), "both sides used the same block ids"
        assert loop.digests[rid] == sent.kv_digest, f"{rid}: KV differs between the two sides"
        assert loop.tokens[rid][0] == sent.first_token
        assert loop.tokens[rid] == expected[rid], f"{rid}: disaggregated decode differs from colocated"
    assert {rid: prefilled[rid].num_cached_tokens for rid in wave2} == EXPECTED_CACHED_TOKENS
    assert_prefill_side_free(prefill_peer)


def test_failed_admission_frees_the_received_blocks(prefill_peer, decode_engine, colocated):
    with pytest.raises(ValueError, match="no prefilled KV|not a prefilled"):
        take_prefilled(colocated.engine, "never-added")
    receiver = make_receiver("grpc", decode_engine)
    try:
        prompt = random_prompts([21], VOCAB, seed=13)[0]
        prefill_peer.call(Prefill((("mismatch", tuple(prompt)),), MAX_TOKENS))
        prefill_peer.call(Ship(("mismatch",), receiver.address))
        received = receiver.wait(30)
        assert isinstance(received, ReceivedKV), received
        assert decode_engine.num_free_blocks == DECODE_BLOCKS - PREFILL_BLOCKS - len(received.block_ids)
        with pytest.raises(ValueError, match="holds 21"):
            admit_received(decode_engine, received, prompt[:-1], GREEDY)
        assert prefill_peer.call(AwaitShipped(("mismatch",))) == {"mismatch": "OK"}
    finally:
        receiver.close()
    assert decode_engine.num_free_blocks == DECODE_BLOCKS - PREFILL_BLOCKS
    assert_prefill_side_free(prefill_peer)
