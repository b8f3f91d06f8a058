"""KV transfer over real gloo between two real processes (sender peer spawned), both ways a gloo pair moves bytes:
on its process group (`group`: inline transfers off, the path NCCL shares) and inline on its control connection
(`inline`: what small transfers take by default)."""
from __future__ import annotations

import pytest

from kv_transfer import DistRendezvous, TransferConfig, create_receiver
from tests.support import kv_scenarios as sc
from tests.support.kv_peer import BF16, FP32, PeerProcess, PeerSpec

TIMEOUT_S = 20.0
SHORT_TIMEOUT_S = 1.0


def _side(namespace: str, dtype: str, peers: list[int], timeout_s: float, inline_max_bytes: int) -> sc.Side:
    pool = sc.receiver_pool(FP32 if dtype == "float32" else BF16)
    gate = sc.Gate(pool)
    config = TransferConfig(transport="gloo", kv_transfer_timeout_s=timeout_s, connect_timeout_s=30,
                            inline_max_bytes=inline_max_bytes)
    rdzv = DistRendezvous(rank=0, world_size=4, namespace=namespace)
    receiver = create_receiver(config, gate.view(), "gloo", rendezvous=rdzv, peers=peers)
    return sc.Side(dtype, pool, gate, receiver, namespace)


@pytest.fixture(scope="module", params=["group", "inline"])
def rig(request):
    inline = 0 if request.param == "group" else TransferConfig.inline_max_bytes
    peer = PeerProcess(PeerSpec("gloo", rank=1, timeout_s=TIMEOUT_S, inline_max_bytes=inline))
    doomed = PeerProcess(PeerSpec("gloo", rank=3, timeout_s=TIMEOUT_S, inline_max_bytes=inline))
    sides = {
        "float32": _side("f32", "float32", [1, 2], TIMEOUT_S, inline),
        "bfloat16": _side("bf16", "bfloat16", [1], TIMEOUT_S, inline),
        "short": _side("short", "float32", [2], SHORT_TIMEOUT_S, inline),
        "doomed": _side("doomed", "float32", [3], TIMEOUT_S, inline),
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


def test_sender_cancels_half_way(rig):
    sc.cancelled_half_way(rig, "float32")


def test_receiver_cancels(rig):
    sc.receiver_cancel(rig, "float32")


def test_no_room_is_rejected_and_link_survives(rig):
    sc.no_room(rig, "float32")


def test_more_blocks_than_the_pool_holds_is_malformed(rig):
    sc.beyond_the_pool(rig, "float32")


def test_corrupted_chunk_is_detected(rig):
    sent = sc.corrupted_chunk(rig, "float32")
    assert sent.status == "CHECKSUM_MISMATCH", sent


def test_receiver_times_out_and_frees(rig):
    sent = sc.receiver_timeout(rig, "short", stall_s=SHORT_TIMEOUT_S + 1.5)
    assert not sent.ok and sent.status == "PEER_FAILED", sent


def test_sender_killed_mid_transfer(rig):
    elapsed = sc.sender_killed(rig, "doomed", failure_status="PEER_FAILED")
    assert elapsed < TIMEOUT_S / 2, f"peer death took {elapsed:.1f}s to notice"
    rig.assert_all_free()
