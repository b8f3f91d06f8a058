"""LanePair: a prefill engine and a decode engine in this process (rank 0; a tensor-parallel one's followers in child
processes), joined by KV lanes (kv_transfer/lanes/) of one transport on 127.0.0.1, as two workers join them: ship a
prefilled request, wait for the decode side's outcome, decode, and check that every block is free."""
from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from engine import SamplingParams
from engine.builder import build_engine
from engine.config import EngineConfig
from kv_transfer import (DistRendezvous, KVTransferError, ReceivedKV, ReceiveFailed, SendResult, TransferConfig,
                         TransferStatus)
from kv_transfer.engine_pool import admit_received, ship_prefilled
from kv_transfer.lanes import LaneHub, LaneReceiver, LaneSender, LaneSpec
from tests.support.child_processes import FORKED_RANKS

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
VOCAB = 300
ENGINE = dict(tensor_parallel_size=2, block_size=8, kv_cache_memory=4 << 20, **FORKED_RANKS)
CONFIG = TransferConfig(kv_transfer_timeout_s=20, connect_timeout_s=30)


def refuse_marked(engine):
    """A decode worker's reservations, as allocate_for: a request whose id starts with "refused" has none."""
    return lambda request_id, n: None if request_id.startswith("refused") else engine.reserve_blocks(n)


def lane_engine(path: str, tp: int, spec: LaneSpec):
    """An engine of tp ranks whose followers run spec as their rank service (one rank: none)."""
    config = EngineConfig(**{**ENGINE, "tensor_parallel_size": tp})
    return build_engine(path, config, "float32", "cpu", tp_rank_service=spec if tp > 1 else None)


class LanePair:
    """A prefill group and a decode group (2 ranks each by default), joined by lanes of one transport."""

    def __init__(self, path: str, transport: str, prefill_tp: int = 2, decode_tp: int = 2) -> None:
        config = TransferConfig(transport=transport, kv_transfer_timeout_s=20, connect_timeout_s=30)
        ranked = transport != "grpc"
        hub = LaneHub()
        spec = LaneSpec("send", transport, config, hub.address, DistRendezvous(1, 2) if ranked else None)
        self.prefill = lane_engine(path, prefill_tp, spec)
        self.sender = LaneSender(self.prefill, hub, spec)
        hub = LaneHub()
        spec = LaneSpec("receive", transport, config, hub.address, DistRendezvous(0, 2) if ranked else None,
                        peers=(1,))
        self.decode = lane_engine(path, decode_tp, spec)
        self.receiver = LaneReceiver(self.decode, hub, spec, allocate_for=refuse_marked(self.decode))

    def prefill_one(self, request_id: str, prompt: list[int]) -> None:
        self.prefill.add_request(request_id, prompt, GREEDY, prefill_only=True)
        while not any(d.kv_block_ids is not None and d.request_id == request_id for d in self.prefill.step()):
            pass

    def ship(self, request_id: str, prefix_blocks: int = 0):
        return ship_prefilled(self.prefill, self.sender, self.receiver.address, request_id,
                              prefix_blocks=prefix_blocks)

    def decode_all(self, admitted: dict[str, tuple]) -> dict[str, list[int]]:
        """Admit each (outcome, prompt, cached blocks) and decode them all; their tokens, first included."""
        tokens = {}
        for request_id, (outcome, prompt, cached) in admitted.items():
            tokens[request_id] = list(admit_received(self.decode, outcome, prompt, GREEDY,
                                                     cached_block_ids=cached).new_token_ids)
        while self.decode.has_unfinished_requests():
            for delta in self.decode.step():
                tokens[delta.request_id] += delta.new_token_ids
        return tokens

    def greedy_with_prefix_reuse(self, prompts: list[list[int]], again: list[int], expected: list[list[int]],
                                 check: Callable[[ReceivedKV, SendResult], None]) -> None:
        """Ships and decodes each prompt (check(outcome, result) on each delivery), then `again`, whose first 6 blocks
        the decode side holds by then (only the rest travel); every request's greedy tokens equal `expected`
        (prompts', then again's), one delivery each, every block free at the end."""
        admitted = {}
        for i, prompt in enumerate(prompts):
            self.prefill_one(f"r{i}", prompt)
            handle = self.ship(f"r{i}")
            outcome = self.receiver.wait(30)
            assert isinstance(outcome, ReceivedKV), outcome
            check(outcome, handle.result(30))
            admitted[f"r{i}"] = (outcome, prompt, ())
        assert self.receiver.wait(0.2) is None  # one delivery per request, whatever its lanes did
        tokens = self.decode_all(admitted)
        assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected[:len(prompts)]
        cached = self.decode.pin_cached_prefix(again)
        assert len(cached) == 6
        self.prefill_one("again", again)
        handle = self.ship("again", prefix_blocks=len(cached))
        outcome = self.receiver.wait(30)
        assert outcome.manifest.prefix_blocks == 6 and len(outcome.block_ids) == 2
        handle.result(30)
        assert self.decode_all({"again": (outcome, again, cached)})["again"] == expected[-1]
        self.assert_all_free()

    def refused_and_cancelled_end_once(self, prompt: list[int]) -> None:
        """A request the decode side holds no reservation for ("refused-1") and one it cancelled before its KV came
        ("cancelled-1") each fail on every lane: the sender's handle raises, the decode side reports it once, and every
        block on both sides is free."""
        self.prefill_one("refused-1", prompt)
        handle = self.ship("refused-1")
        outcome = self.receiver.wait(30)
        assert isinstance(outcome, ReceiveFailed) and outcome.status == TransferStatus.REJECTED_NO_BLOCKS
        with pytest.raises(KVTransferError):
            handle.result(30)
        self.receiver.cancel("cancelled-1")
        self.prefill_one("cancelled-1", prompt)
        handle = self.ship("cancelled-1")
        outcome = self.receiver.wait(30)
        assert isinstance(outcome, ReceiveFailed) and outcome.status == TransferStatus.CANCELLED
        with pytest.raises(KVTransferError):
            handle.result(30)
        assert self.receiver.wait(0.5) is None  # one outcome per request, whatever its lanes did
        self.assert_all_free()

    def assert_all_free(self) -> None:
        """Every block of both engines free (waiting up to 10 s for the last lanes to end)."""
        deadline = time.monotonic() + 10
        for engine in (self.prefill, self.decode):
            while engine.num_free_blocks != engine.num_total_blocks and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.num_live_requests == 0
            assert engine.num_free_blocks == engine.num_total_blocks, "a KV block leaked"

    def close(self) -> None:
        for link in (self.sender, self.receiver):
            link.close()
        try:
            self.assert_all_free()
        finally:
            self.prefill.close()
            self.decode.close()
