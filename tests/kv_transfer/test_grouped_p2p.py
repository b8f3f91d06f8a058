"""How a PairChannel posts several tensors: one grouped operation where the process group coalesces
point-to-point calls (NCCL's ProcessGroupNCCL does; it cannot run here, so a recording stand-in with the
same backend methods plays it), one call per tensor where it does not (gloo, for real, over loopback), and
one call per tensor, with a warning, where starting a group fails (a torch whose binding differs)."""
from __future__ import annotations

import socket
import threading
import time

import torch

from kv_transfer import ModelFingerprint, SendRequest
from kv_transfer.control.connection import ControlConnection
from kv_transfer.control.pair_store import PEER_ADD_PREFIX, PairStore
from kv_transfer.dist.channel import RECEIVER, SENDER, PairChannel
from kv_transfer.dist.protocol import receive_pieces, send_pieces
from kv_transfer.incoming import IncomingTransfer
from kv_transfer.manifest_decode import decode_manifest
from kv_transfer.outgoing import prepare_outgoing
from kv_transfer.staging import StagingPool
from kv_transfer.testing import FreeListPool


class _Work:
    def wait(self, timeout=None) -> bool:
        return True


class RecordingGroup:
    """The backend methods a PairChannel calls, recording them; coalescing as NCCL's group offers it."""

    supports_coalescing = True

    def __init__(self, start_error: Exception | None = None) -> None:
        self.calls: list[str] = []
        self.start_error = start_error

    def _start_coalescing(self) -> None:
        if self.start_error is not None:
            raise self.start_error
        self.calls.append("start")

    def _end_coalescing(self) -> _Work:
        self.calls.append("end")
        return _Work()

    def send(self, tensors, peer, tag) -> _Work:
        self.calls.append(f"send {tensors[0].numel()} to {peer}")
        return _Work()

    def recv(self, tensors, peer, tag) -> _Work:
        self.calls.append(f"recv {tensors[0].numel()} from {peer}")
        return _Work()


def _channel(group, role: int = SENDER) -> PairChannel:
    channel = PairChannel("gloo", role=role, device=torch.device("cpu"), connect_timeout_s=1.0)
    channel._group = group  # as connect() leaves it
    return channel


def test_a_coalescing_group_gets_the_planes_as_one_grouped_operation():
    group = RecordingGroup()
    channel = _channel(group)
    planes = [torch.zeros(n) for n in (3, 4, 5)]
    works = channel.post_sends(planes)
    assert len(works) == 1
    assert group.calls == ["start", "end", "start", "send 3 to 1", "send 4 to 1", "send 5 to 1", "end"]
    group.calls.clear()
    assert len(_channel(group, RECEIVER).post_recvs(planes[:2])) == 1
    assert group.calls == ["start", "end", "start", "recv 3 from 0", "recv 4 from 0", "end"]
    group.calls.clear()
    assert len(channel.post_sends(planes[:1])) == 1 and group.calls == ["send 3 to 1"]  # one alone: no group


def test_a_group_that_cannot_start_falls_back_to_one_call_per_tensor(caplog):
    group = RecordingGroup(start_error=TypeError("_start_coalescing(): incompatible function arguments"))
    channel = _channel(group)
    works = channel.post_sends([torch.zeros(2), torch.zeros(3)])
    assert len(works) == 2 and group.calls == ["send 2 to 1", "send 3 to 1"]
    assert "does not group point-to-point calls" in caplog.text
    group.calls.clear()
    channel.post_sends([torch.zeros(2), torch.zeros(3)])
    assert group.calls == ["send 2 to 1", "send 3 to 1"]  # decided once


def test_gloo_posts_one_call_per_tensor_and_the_tensors_arrive_in_order():
    with socket.create_server(("127.0.0.1", 0)) as server:  # the pair's control connection, both ends here
        left = socket.create_connection(server.getsockname())
        right, _ = server.accept()
    conns = [ControlConnection(left, "sender"), ControlConnection(right, "receiver")]
    ends = [PairChannel("gloo", role, torch.device("cpu"), connect_timeout_s=30.0) for role in (SENDER, RECEIVER)]
    sent = [torch.arange(n, dtype=torch.float32) for n in (5, 7, 11)]
    received = [torch.zeros(n) for n in (5, 7, 11)]
    connected = threading.Thread(target=ends[RECEIVER].connect, args=(conns[RECEIVER],))
    connected.start()
    ends[SENDER].connect(conns[SENDER])
    connected.join()
    try:
        sends, recvs = ends[SENDER].post_sends(sent), ends[RECEIVER].post_recvs(received)
        assert len(sends) == len(recvs) == 3  # gloo groups nothing
        deadline = time.monotonic() + 30
        for work in recvs:
            ends[RECEIVER].wait(work, deadline, "recv")
        for work in sends:
            ends[SENDER].wait(work, deadline, "send")
        assert all(torch.equal(a, b) for a, b in zip(sent, received))
    finally:
        for end, conn in zip(ends, conns):
            end.close()
            conn.close()


def test_a_whole_transfer_is_one_grouped_operation_on_each_side_of_a_coalescing_group():
    """NCCL's path, on the recording stand-in: all runs of a whole-request transfer (here 3 runs of direct
    planes) leave as one grouped send and arrive as one grouped receive; the receiver lands every run."""
    fp = ModelFingerprint(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
    sender_pool, receiver_pool = FreeListPool(fp, 16), FreeListPool(fp, 16)
    blocks = (1, 2, 5, 6, 9)  # runs (1, 2), (5, 6), (9)
    request = SendRequest("grouped", blocks, len(blocks) * fp.block_size, 3)
    outgoing = prepare_outgoing(sender_pool.view(), request, StagingPool("cpu"), direct_min_plane_bytes=0)
    assert all(outgoing.direct) and outgoing.num_pieces == 3
    planes = 2 * fp.num_layers * outgoing.num_pieces
    sent = RecordingGroup()
    send_pieces(_channel(sent), outgoing, time.monotonic() + 10)
    assert sent.calls[:2] == ["start", "end"] and sent.calls[2] == "start" and sent.calls[-1] == "end"
    assert len(sent.calls) == 4 + planes and all(c.startswith("send ") for c in sent.calls[3:-1])
    received = RecordingGroup()
    incoming = IncomingTransfer.accept(decode_manifest(outgoing.manifest_bytes, receiver_pool.view().manifest_limits),
                                       receiver_pool.view(), StagingPool("cpu"))
    assert receive_pieces(_channel(received, RECEIVER), incoming, bytes(outgoing.direct), time.monotonic() + 10)
    assert len(received.calls) == 4 + planes and received.calls[2] == "start" and received.calls[-1] == "end"
    got = incoming.commit()  # both pools are zeros: every run's checksum holds
    assert len(got.block_ids) == len(blocks)
    receiver_pool.free(got.block_ids)


def test_a_pair_store_counter_sums_both_ends():
    """PairStore.add (what a process group may use for a two-party counter): both ends' adds count, set and
    get travel on the control connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        left = socket.create_connection(server.getsockname())
        right, _ = server.accept()
    stores = [PairStore(ControlConnection(sock), 10.0) for sock in (left, right)]
    assert stores[0].add("n", 1) == 1 and stores[1].add("n", 2) == 2  # each end's own adds count at once
    for store in stores:                                              # and both, once the other's total is in
        store.wait([PEER_ADD_PREFIX + "n"])
        assert store.get("n") == b"3"
    stores[1].set("ready", b"yes")
    assert stores[0].get("ready") == b"yes"
    for store in stores:
        store.conn.close()
