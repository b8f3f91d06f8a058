"""KV lanes: a tensor-parallel group's KV moves rank to rank, each head straight from a prefill rank that computed it
to the decode ranks that hold it, with no hop through either group's rank 0, between groups of any sizes (a worker of
one rank counts as a group of one). (A KV lane is one rank's share of a group's transfers; TransferConfig.dist_lanes
is something else: the parallel connections of one sender/receiver pair, which every lane's own transport has too.)

    prefill group (A ranks)                    decode group (B = A ranks, the same head layout)
    rank 0 [h0 h1] ── heads h0 h1 ──────────►  rank 0 [h0 h1]   each arrow: one ordinary transfer of the rank's
    rank 1 [h2 h3] ── heads h2 h3 ──────────►  rank 1 [h2 h3]   pool (its manifest says kv_heads; checksums,
                                                                 any transport but ipc)

Between sizes a request travels in parts (`parts.py`): merged on a receiving rank (`assembly.py`) or split from a
sending rank's pool narrowed to each part's heads.

Every rank runs a lane: a KVSender or KVReceiver over its own pool (`rank_lane.py`), on followers as the engine's
rank service (engine/parallel/rank_service.py). Rank 0 talks to its followers' lanes over a private Unix socket
(`hub.py`: Ship / Expect / Forget / Cancel out, one LaneEnded back per Ship or Expect) and is the only side that
owns blocks: LaneSender (`group_sender.py`) frees a request's blocks once every rank's lane ended, LaneReceiver
(`group_receiver.py`) reserves them, tells the followers which ids to land in, and delivers the request when every
rank's lane landed (or fails it, freeing the blocks once no lane can write them any more). Both are the KVSender /
KVReceiver a worker holds; a receiver's ReceiverAddress lists its ranks' lane targets.
"""
from kv_transfer.lanes.group import GroupLanes
from kv_transfer.lanes.group_receiver import LaneReceiver
from kv_transfer.lanes.group_sender import LaneSender
from kv_transfer.lanes.hub import LaneHub
from kv_transfer.lanes.rank_lane import LaneSpec

__all__ = ["GroupLanes", "LaneHub", "LaneReceiver", "LaneSender", "LaneSpec"]
