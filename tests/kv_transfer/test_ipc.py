"""KV transfer over transport 'ipc' between two real processes: the receivers (and their control listeners) live
in the pytest process, the senders in a spawned peer (tests/support/kv_ipc_peer.py) whose pools the receivers map.

Everything runs on CPU pools in shared memory, which take the transport's whole path (publish the pool
handle once per connection, map it, one gather and one scatter into the receiver's blocks, reply); with CUDA
the same scenarios run again between two processes on one GPU (the CUDA IPC handles, the copy on a side
stream). Every scenario ends with every block free on both sides."""
from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
import torch

from kv_transfer import DistRendezvous, TransferConfig, create_receiver
from kv_transfer.testing import FreeListPool
from tests.support import kv_scenarios as sc
from tests.support.kv_ipc_peer import IpcPeerProcess, IpcPeerSpec
from tests.support.kv_peer import BF16, FP32, Fault, Wait

TIMEOUT_S = 20.0
SHORT_TIMEOUT_S = 1.0
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def _side(namespace: str, dtype: str, peers: list[int], device: str, fp=None,
          timeout_s: float = TIMEOUT_S) -> sc.Side:
    """A receiver whose pool (layout fp, default: the peer's `dtype` pool) hands out shuffled ids; `dtype`
    names the peer pool that sends to it."""
    order = list(range(sc.RECEIVER_BLOCKS))
    random.Random(7).shuffle(order)
    pool = FreeListPool(fp or (FP32 if dtype == "float32" else BF16), sc.RECEIVER_BLOCKS, device, order)
    gate = sc.Gate(pool)
    config = TransferConfig(transport="ipc", kv_transfer_timeout_s=timeout_s, connect_timeout_s=30)
    rdzv = DistRendezvous(rank=0, world_size=4, namespace=namespace)
    receiver = create_receiver(config, gate.view(), "ipc", rendezvous=rdzv, peers=peers)
    return sc.Side(dtype, pool, gate, receiver, namespace)


@pytest.fixture(scope="module", params=DEVICES)
def rig(request):
    device = request.param
    peer = IpcPeerProcess(IpcPeerSpec("ipc", rank=1, timeout_s=TIMEOUT_S, device=device))
    doomed = IpcPeerProcess(IpcPeerSpec("ipc", rank=3, timeout_s=TIMEOUT_S, device=device))
    sides = {  # rank 2 is the peer's hand-driven sender: one fault per side
        "float32": _side("f32", "float32", [1, 2], device),
        "bfloat16": _side("bf16", "bfloat16", [1], device),
        "short": _side("short", "float32", [2], device, timeout_s=SHORT_TIMEOUT_S),
        "doomed": _side("doomed", "float32", [3], device),
        "handle": _side("handle", "float32", [1, 2], device),
        "bs8": _side("bs8", "float32", [1], device, fp=replace(FP32, block_size=8)),
        "into-bf16": _side("into-bf16", "float32", [1], device, fp=replace(FP32, dtype="bfloat16")),
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


def test_sender_cancels_at_once(rig):
    sc.cancelled_at_once(rig, "float32")


def test_receiver_cancels(rig):
    sc.receiver_cancel(rig, "float32")


def test_no_room_is_rejected_and_the_pool_is_published_again(rig):
    sc.no_room(rig, "float32")


def test_more_blocks_than_the_pool_holds_is_malformed(rig):
    sc.beyond_the_pool(rig, "float32")


@pytest.mark.parametrize("side, differs", [("bs8", "block_size"), ("into-bf16", "dtype")])
def test_another_layout_is_rejected(rig, side, differs):
    start = rig.start(f"layout-{side}", side, (3, 4, 5), seed=2)
    assert rig.peer.call(start).ok
    sent = rig.peer.call(Wait(start.key))
    assert sent.status == "REJECTED_FINGERPRINT", sent
    assert differs in sc.take_failure(rig.sides[side], "REJECTED_FINGERPRINT").message
    rig.assert_all_free()


def test_corrupted_pool_is_detected(rig):
    sent = sc.corrupted_chunk(rig, "float32")
    assert sent.status == "CHECKSUM_MISMATCH", sent


def test_a_refused_pool_handle_declines_the_transfer(rig):
    """A handle naming any callable but torch's rebuild functions is never unpickled: the manifest is
    declined (MALFORMED, nothing allocated) and the next sender on that receiver is served."""
    start = rig.start("bad-handle", "handle", (1, 2, 3), seed=12)
    sent = rig.peer.call(Fault("bad-handle", start))
    assert sent.status == "MALFORMED", sent
    assert "may not refer to posix.getpid" in sc.take_failure(rig.sides["handle"], "MALFORMED").message
    sc.send_and_check(rig, "handle", rig.start("after-bad-handle", "handle", (4, 5, 6), seed=13))
    rig.assert_all_free()


def _links_end(side: sc.Side, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while side.receiver._links and time.monotonic() < deadline:
        time.sleep(0.02)
    return not side.receiver._links


def test_a_sender_stalled_mid_frame_is_dropped_after_the_deadline(rig):
    """ipc's TRANSFER frame is the go-ahead, so the one place a sender can stall is inside it: the
    receiver reads a begun frame for at most its transfer timeout, then drops the connection; nothing was
    allocated."""
    start = rig.start("stalled", "short", range(40, 48), seed=9)
    rig.peer.conn.send(Fault("stall", start, stall_s=SHORT_TIMEOUT_S + 1.5))
    assert rig.peer.reply().status == "STALLED"
    assert _links_end(rig.sides["short"], SHORT_TIMEOUT_S + 5), "the stalled connection is still served"
    assert rig.peer.reply(30).status == "STALLED"
    rig.assert_all_free()


def test_sender_killed_mid_frame(rig):
    """The sending process dies inside its TRANSFER frame: the receiver's link ends at once, nothing held."""
    start = rig.start("doomed", "doomed", range(0, 16), seed=11)
    rig.doomed.conn.send(Fault("hang", start, rank=3))
    assert rig.doomed.reply().status == "STALLED"
    began = time.monotonic()
    rig.doomed.kill()
    assert _links_end(rig.sides["doomed"], 10), "the dead sender's connection is still served"
    assert time.monotonic() - began < TIMEOUT_S / 2
    rig.assert_all_free()
