"""KV transfer over the real gRPC KVTransfer.Push stream on loopback between two real processes."""
from __future__ import annotations

import asyncio
import time

import pytest

from kv_transfer import ReceiveFailed, TransferConfig, create_receiver
from tests.support import kv_scenarios as sc
from tests.support.kv_peer import BF16, FP32, Fault, PeerProcess, PeerSpec, Wait

TIMEOUT_S = 20.0
SHORT_TIMEOUT_S = 1.0


def _side(dtype: str, timeout_s: float, **limits) -> sc.Side:
    pool = sc.receiver_pool(FP32 if dtype == "float32" else BF16)
    gate = sc.Gate(pool)
    config = TransferConfig(transport="grpc", kv_transfer_timeout_s=timeout_s, connect_timeout_s=30, **limits)
    return sc.Side(dtype, pool, gate, create_receiver(config, gate.view(), "grpc", host="127.0.0.1", port=0))


@pytest.fixture(scope="module")
def rig():
    peer = PeerProcess(PeerSpec("grpc", timeout_s=TIMEOUT_S))
    doomed = PeerProcess(PeerSpec("grpc", timeout_s=TIMEOUT_S))
    sides = {
        "float32": _side("float32", TIMEOUT_S),
        "bfloat16": _side("bfloat16", TIMEOUT_S),
        "short": _side("float32", SHORT_TIMEOUT_S),
        "doomed": _side("float32", TIMEOUT_S),
        "one-slot": _side("float32", TIMEOUT_S, grpc_max_concurrent_transfers=1, grpc_max_queued_transfers=8),
    }
    yield sc.Rig(peer, doomed, sides)
    peer.stop()
    doomed.stop()
    for side in sides.values():
        side.receiver.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_arrive_bit_exact(rig, dtype):
    sc.bit_exact_layouts(rig, dtype)


def test_several_transfers_in_flight(rig):
    sc.several_in_flight(rig, "float32")


def test_transfers_beyond_the_slots_queue_and_complete(rig):
    """Four transfers at once to a receiver with one slot: they wait their turn (gRPC used to refuse the
    calls past its limit) and all arrive bit for bit, every block freed."""
    sc.several_in_flight(rig, "one-slot")


def test_sender_cancels_half_way(rig):
    sc.cancelled_half_way(rig, "float32", bytes_may_be_out=True)


def test_sender_cancels_at_once(rig):
    sc.cancelled_at_once(rig, "float32")


def test_receiver_cancels(rig):
    sc.receiver_cancel(rig, "float32")


def test_no_room_is_rejected(rig):
    sc.no_room(rig, "float32")


def test_more_blocks_than_the_pool_holds_is_malformed(rig):
    sc.beyond_the_pool(rig, "float32")


def test_corrupted_chunk_is_detected(rig):
    sent = sc.corrupted_chunk(rig, "float32")
    assert sent.status == "KV_CHECKSUM_MISMATCH", sent


def test_truncated_stream_is_detected(rig):
    start = rig.start("truncated", "float32", (20, 21, 22, 50), seed=12)
    sent = rig.peer.call(Fault("truncate", start))
    assert sent.status == "KV_LENGTH_MISMATCH", sent
    sc.take_failure(rig.sides["float32"], "LENGTH_MISMATCH")
    rig.assert_all_free()


@pytest.mark.parametrize("mode, status", [
    ("bad-trailer", "CHECKSUM_MISMATCH"),  # the run's bytes are fine, its trailing checksum is not
    ("no-trailer", "LENGTH_MISMATCH"),  # the stream ends before the last run's checksum
    ("early-data", "MALFORMED"),  # run 1's bytes where run 0's checksum is due
    ("stray-trailer", "MALFORMED"),  # the manifest holds every checksum, a trailing one follows anyway
])
def test_trailing_checksum_faults_are_detected(rig, mode, status):
    """Each run's checksum may follow its bytes (what GrpcSender sends); a wrong, missing or misplaced one
    fails the transfer with nothing delivered and every block free on both sides."""
    start = rig.start(f"trailer-{mode}", "float32", (20, 21, 22, 50), seed=13)  # two runs
    sent = rig.peer.call(Fault(mode, start))
    assert sent.status == f"KV_{status}", sent
    sc.take_failure(rig.sides["float32"], status)
    rig.assert_all_free()


def test_receiver_times_out_and_frees(rig):
    sent = sc.receiver_timeout(rig, "short", stall_s=SHORT_TIMEOUT_S + 1.5)
    assert sent.status == "KV_TIMEOUT", sent


def test_sender_killed_mid_transfer(rig):
    elapsed = sc.sender_killed(rig, "doomed", failure_status="PEER_FAILED")
    assert elapsed < TIMEOUT_S / 2, f"peer death took {elapsed:.1f}s to notice"
    rig.assert_all_free()


def test_a_handler_cancelled_after_commit_frees_its_blocks(rig, monkeypatch):
    """The transfer is committed (blocks written and verified) and then the handler is cancelled (the
    client went away before the ack): CancelledError is no Exception, and the blocks must still be
    freed, with one ReceiveFailed in the inbox, and the receiver must go on serving."""
    side = rig.sides["doomed"]
    real_commit = type(side.receiver)._commit

    async def commit_then_cancelled(self, incoming):
        received = await real_commit(self, incoming)
        asyncio.current_task().cancel()  # the next await in the handler (the ack's write) raises
        return received

    monkeypatch.setattr(type(side.receiver), "_commit", commit_then_cancelled)
    start = rig.start("cancelled-after-commit", "doomed", range(30, 36), seed=9)
    assert rig.peer.call(start).ok
    rig.peer.call(Wait(start.key))  # the sender sees the stream end without an ack: a failure of its own
    failure = side.receiver.wait(10)
    assert isinstance(failure, ReceiveFailed) and failure.request_id == start.key, failure
    monkeypatch.undo()
    time.sleep(0.2)  # the failure is reported before the session's status goes out; let the sender see it
    sc.send_and_check(rig, "doomed", rig.start("after-cancelled-commit", "doomed", (1, 2), seed=10))
    rig.assert_all_free()
