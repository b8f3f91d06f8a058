"""A gloo receiver's senders change while it runs (a prefill worker added or drained while serving): a rank
added with add_peer is heard from its first transfer on, bit for bit; adding it again changes nothing; a
removed rank's link thread ends and its channel closes. The sender is a real spawned peer process."""
from __future__ import annotations

import pytest

from kv_transfer import DistRendezvous, TransferConfig, create_receiver
from tests.support import kv_scenarios as sc
from tests.support.kv_peer import FP32, PeerProcess, PeerSpec

TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def rig():
    peer = PeerProcess(PeerSpec("gloo", rank=1, timeout_s=TIMEOUT_S))
    pool = sc.receiver_pool(FP32)
    gate = sc.Gate(pool)
    config = TransferConfig(transport="gloo", kv_transfer_timeout_s=TIMEOUT_S, connect_timeout_s=30)
    rendezvous = DistRendezvous(rank=0, world_size=4, namespace="late")
    receiver = create_receiver(config, gate.view(), "gloo", rendezvous=rendezvous, peers=[])   # listens to none
    yield sc.Rig(peer, peer, {"late": sc.Side("float32", pool, gate, receiver, "late")})
    peer.stop()
    receiver.close()


def test_a_sender_added_while_running_is_heard_and_a_removed_one_is_let_go(rig):
    receiver = rig.sides["late"].receiver
    receiver.add_peer(1)
    receiver.add_peer(1)                      # already listening: changes nothing
    for i, blocks in enumerate([(4, 5, 6), (30, 31)]):
        sc.send_and_check(rig, "late", rig.start(f"late-{i}", "late", blocks, seed=40 + i))
    links = list(receiver._links)             # a connection per lane that carried a transfer
    assert links and all(link.peer_rank == 1 for link in links) and len(links) <= receiver.config.dist_lanes
    receiver.remove_peer(1)
    for link in links:
        link.thread.join(TIMEOUT_S)
        assert not link.thread.is_alive() and (link.channel is None or link.channel.broken is None)  # inline: none
    assert receiver._links == []
    receiver.remove_peer(1)                   # not listening: nothing to do
    rig.assert_all_free()
