"""Transfer scenarios shared by the gloo and gRPC test files: the receivers live in the pytest process,
the senders in a spawned peer (kv_peer.py). Every scenario ends with all blocks free on both sides."""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import torch

from kv_transfer import KVPoolView, KVReceiver, ModelFingerprint, ReceivedKV, ReceiveFailed
from kv_transfer.pool import TORCH_DTYPES
from kv_transfer.testing import FreeListPool, blocks_bytes, fill_blocks
from tests.support.kv_peer import (BF16, FP32, SENDER_BLOCKS, Cancel, Fault, FreeCounts, Outcome, PeerProcess, Start,
                                   Wait)

RECEIVER_BLOCKS = 96


class Gate:
    """Wraps a pool's allocate so a test can hold a transfer right after its manifest arrived."""

    def __init__(self, pool: FreeListPool):
        self.pool = pool
        self.entered = threading.Event()
        self.open = threading.Event()
        self.open.set()

    def allocate(self, n: int) -> list[int] | None:
        self.entered.set()
        self.open.wait(30)
        return self.pool.allocate(n)

    def view(self) -> KVPoolView:
        return KVPoolView(self.pool.kv, self.allocate, self.pool.free)


def receiver_pool(fp: ModelFingerprint) -> FreeListPool:
    """A receiver pool whose free list is shuffled, so destination ids are non-contiguous."""
    order = list(range(RECEIVER_BLOCKS))
    random.Random(7).shuffle(order)
    return FreeListPool(fp, RECEIVER_BLOCKS, free_order=order)


@dataclass
class Side:
    """One receiver (with its pool) the peer can send to."""

    dtype: str
    pool: FreeListPool
    gate: Gate
    receiver: KVReceiver
    namespace: str = ""


@dataclass
class Rig:
    peer: PeerProcess
    doomed: PeerProcess
    sides: dict[str, Side]

    def start(self, key: str, side: str, block_ids, num_tokens: int | None = None, seed: int = 0) -> Start:
        s = self.sides[side]
        fp = FP32 if s.dtype == "float32" else BF16
        tokens = num_tokens if num_tokens is not None else len(block_ids) * fp.block_size
        return Start(key, s.dtype, s.receiver.address, tuple(block_ids), tokens, seed, s.namespace)

    def assert_all_free(self) -> None:
        for name, side in self.sides.items():
            assert side.pool.num_free == RECEIVER_BLOCKS, f"receiver pool {name} leaks blocks"
        free = self.peer.call(FreeCounts()).free
        assert free == {"float32": SENDER_BLOCKS, "bfloat16": SENDER_BLOCKS}, f"sender pools leak: {free}"


def expected_bytes(fp: ModelFingerprint, num_blocks: int, seed: int) -> bytes:
    """What the peer wrote into the blocks it sent (fill_blocks is deterministic per seed and order)."""
    shape = (fp.num_layers, 2, num_blocks, fp.block_size, fp.num_kv_heads, fp.head_dim)
    scratch = torch.zeros(shape, dtype=TORCH_DTYPES[fp.dtype])
    fill_blocks(scratch, range(num_blocks), seed)
    return blocks_bytes(scratch, range(num_blocks))


def check_received(side: Side, outcome, start: Start) -> ReceivedKV:
    """Checks a delivery of start bit for bit, then frees the blocks the test now owns."""
    assert isinstance(outcome, ReceivedKV), f"expected a delivery, got {outcome}"
    m = outcome.manifest
    assert (m.request_id, m.num_tokens, m.first_token, m.block_ids) == (start.key, start.num_tokens, start.seed, start.block_ids)
    assert len(outcome.block_ids) == len(start.block_ids)
    assert blocks_bytes(side.pool.kv, outcome.block_ids) == expected_bytes(m.fingerprint, len(start.block_ids), start.seed)
    side.pool.free(outcome.block_ids)
    return outcome


def take_received(side: Side, start: Start, timeout: float = 30) -> ReceivedKV:
    return check_received(side, side.receiver.wait(timeout), start)


def take_failure(side: Side, status: str, timeout: float = 30) -> ReceiveFailed:
    outcome = side.receiver.wait(timeout)
    assert isinstance(outcome, ReceiveFailed), f"expected a failure, got {outcome}"
    assert outcome.status.name == status, outcome
    return outcome


def send_and_check(rig: Rig, side: str, start: Start) -> ReceivedKV:
    assert rig.peer.call(start).ok
    sent = rig.peer.call(Wait(start.key))
    assert sent.ok, sent
    return take_received(rig.sides[side], start)


# ---- scenarios ----

def bit_exact_layouts(rig: Rig, side: str) -> None:
    """A one-block run + a partial block, one long run, and mixed runs, into shuffled receiver ids."""
    bs = (FP32 if rig.sides[side].dtype == "float32" else BF16).block_size
    cases = [((5, 9), bs + 1), (tuple(range(20, 84)), 64 * bs - 3), ((3, 4, 5, 90, 91, 140), 6 * bs)]
    for i, (blocks, tokens) in enumerate(cases):
        got = send_and_check(rig, side, rig.start(f"{side}-layout-{i}", side, blocks, tokens, seed=10 + i))
        assert got.block_ids != blocks
    rig.assert_all_free()


def several_in_flight(rig: Rig, side: str) -> None:
    starts = [rig.start(f"multi-{i}", side, range(10 * i, 10 * i + 7), seed=100 + i) for i in range(4)]
    for start in starts:
        assert rig.peer.call(start).ok
    for start in starts:
        assert rig.peer.call(Wait(start.key)).ok
    by_key = {s.key: s for s in starts}
    for _ in starts:
        outcome = rig.sides[side].receiver.wait(30)
        check_received(rig.sides[side], outcome, by_key[getattr(outcome, "request_id", "")])
    rig.assert_all_free()


def cancelled_half_way(rig: Rig, side: str, bytes_may_be_out: bool = False) -> Outcome:
    """The sender cancels while the receiver holds the transfer right after its manifest. bytes_may_be_out: the
    sender sends a small transfer's bytes behind its manifest without waiting to be accepted (gRPC's sessions), so
    the receiver may land them and deliver before the cancel reaches it; either way both sides end free."""
    s = rig.sides[side]
    s.gate.entered.clear()
    s.gate.open.clear()
    start = rig.start("cancel-me", side, range(30, 50), seed=3)
    assert rig.peer.call(start).ok
    assert s.gate.entered.wait(30)
    assert rig.peer.call(Cancel(start.key)).ok
    s.gate.open.set()
    sent = rig.peer.call(Wait(start.key))
    outcome = s.receiver.wait(30)
    if bytes_may_be_out and isinstance(outcome, ReceivedKV):  # the bytes won the race: the blocks are ours
        s.pool.free(outcome.block_ids)
    else:
        assert not sent.ok and sent.status == "CANCELLED", sent
        assert isinstance(outcome, ReceiveFailed) and outcome.request_id == start.key, outcome
    rig.assert_all_free()
    return sent


def cancelled_at_once(rig: Rig, side: str) -> None:
    """A cancel right behind the send (before the transfer's call is even set up) still ends it, and
    frees both sides, whichever way the race goes."""
    s = rig.sides[side]
    start = rig.start("cancel-at-once", side, range(100, 140), seed=6)
    assert rig.peer.call(start).ok
    assert rig.peer.call(Cancel(start.key)).ok
    sent = rig.peer.call(Wait(start.key))
    assert sent.ok or sent.status == "CANCELLED", sent
    outcome = s.receiver.wait(3)
    if isinstance(outcome, ReceivedKV):  # the transfer won the race: the blocks are ours to free
        s.pool.free(outcome.block_ids)
    rig.assert_all_free()


def receiver_cancel(rig: Rig, side: str) -> None:
    start = rig.start("unwanted", side, range(60, 64), seed=4)
    rig.sides[side].receiver.cancel(start.key)
    assert rig.peer.call(start).ok
    sent = rig.peer.call(Wait(start.key))
    assert sent.status == "CANCELLED", sent
    take_failure(rig.sides[side], "CANCELLED")
    send_and_check(rig, side, rig.start("after-cancel", side, (1, 2), seed=5))
    rig.assert_all_free()


def no_room(rig: Rig, side: str) -> None:
    """The pool has 8 blocks free and the transfer needs 12: refused, nothing allocated; the next fits."""
    pool = rig.sides[side].pool
    held = pool.allocate(RECEIVER_BLOCKS - 8)
    start = rig.start("too-big", side, range(0, 12), seed=6)
    assert rig.peer.call(start).ok
    sent = rig.peer.call(Wait(start.key))
    assert sent.status == "REJECTED_NO_BLOCKS", sent
    take_failure(rig.sides[side], "REJECTED_NO_BLOCKS")
    assert pool.num_free == 8
    pool.free(held)
    send_and_check(rig, side, rig.start("after-reject", side, (7, 8, 9), seed=7))
    rig.assert_all_free()


def beyond_the_pool(rig: Rig, side: str) -> None:
    """More blocks than the receiver's whole pool could ever hold: refused as MALFORMED from the manifest
    alone (nothing allocated, the link stays usable)."""
    start = rig.start("beyond", side, range(0, RECEIVER_BLOCKS + 4), seed=6)
    assert rig.peer.call(start).ok
    sent = rig.peer.call(Wait(start.key))
    assert sent.status == "MALFORMED", sent
    assert f"at most {RECEIVER_BLOCKS} entries" in take_failure(rig.sides[side], "MALFORMED").message
    send_and_check(rig, side, rig.start("after-beyond", side, (7, 8, 9), seed=7))
    rig.assert_all_free()


def corrupted_chunk(rig: Rig, side: str) -> Outcome:
    start = rig.start("corrupt", side, (11, 12, 13, 70), seed=8)
    sent = rig.peer.call(Fault("corrupt", start))
    take_failure(rig.sides[side], "CHECKSUM_MISMATCH")
    rig.assert_all_free()
    return sent


def receiver_timeout(rig: Rig, side: str, stall_s: float) -> Outcome:
    """The sender stalls after the manifest; the receiver gives up after its timeout and frees."""
    start = rig.start("stalled", side, range(40, 48), seed=9)
    rig.peer.conn.send(Fault("stall", start, stall_s=stall_s))
    assert rig.peer.reply().status == "STALLED"
    take_failure(rig.sides[side], "TIMEOUT", timeout=stall_s + 10)
    sent = rig.peer.reply()
    rig.assert_all_free()
    return sent


def sender_killed(rig: Rig, side: str, failure_status: str, rank: int = 3) -> float:
    """The sending process is SIGKILLed mid-transfer; the receiver frees and reports, without a hang."""
    start = rig.start("doomed", side, range(0, 16), seed=11)
    rig.doomed.conn.send(Fault("hang", start, rank=rank))
    assert rig.doomed.reply().status == "STALLED"
    deadline = time.monotonic() + 10
    while rig.sides[side].pool.num_free != RECEIVER_BLOCKS - 16 and time.monotonic() < deadline:
        time.sleep(0.01)  # the receiver allocates once the manifest has arrived
    assert rig.sides[side].pool.num_free == RECEIVER_BLOCKS - 16
    began = time.monotonic()
    rig.doomed.kill()
    take_failure(rig.sides[side], failure_status, timeout=30)
    assert rig.sides[side].pool.num_free == RECEIVER_BLOCKS
    return time.monotonic() - began
