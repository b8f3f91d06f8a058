"""Tensor parallelism (EngineConfig.tensor_parallel_size): the pieces every engine room may use.

layout.py        which heads / rows each rank holds (TPLayout), and whether a model splits (check_tp_shapes)
group.py         TPGroup: the group's collectives over torch.distributed (NCCL on GPUs, gloo on CPU)
step_message.py  the one message per step rank 0 sends the other ranks

Built on them, in their rooms: engine/model/tp_layers.py (row-parallel linear, vocab-parallel embedding and LM
head), engine/model/tp_weights.py (each rank's checkpoint slices), engine/runner/tp_leader.py and tp_follower.py
(rank 0's side and the follower ranks: processes it spawns, or a FollowerLauncher's, such as the Ray actors of a
serving worker, cluster/workers/tp_group.py), engine/core/tp_engine.py (building an engine over a group).
"""
