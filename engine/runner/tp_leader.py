"""TPLeader: rank 0's side of a tensor-parallel group, in the engine's process. It starts the follower ranks
(1..N-1, engine/runner/tp_follower.py) through a FollowerLauncher, connects the group, and then, for each step,
sends the step's inputs as one message (StepChannel) before rank 0 runs its own forward. close() stops every
follower: STOP, then a bounded wait, then a kill; a failed start kills them at once. Nothing of the group outlives
the engine.

Launchers: ProcessLauncher (engine/runner/process_ranks.py, the default: child processes, spawned or forked from the
fork server, the cores or GPUs of this host divided among the ranks) and, for a serving worker on Ray,
cluster/workers/tp_group.py (one Ray actor per rank in the worker's placement group, each with its own GPU or CPU
share). The engine imports no Ray: it sees FollowerRanks only.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv.kv_cache import KVCache, KVCacheSpec
from engine.model.tp_layers import TPShard
from engine.parallel.group import CONNECT_TIMEOUT_S, Rendezvous, TPGroup, connect_group, open_store
from engine.parallel.group_files import private_store_path, remove_group_files, remove_stale_group_files
from engine.parallel.host_reduce import MAX_SLOT_BYTES, create_file, shared_memory_dir
from engine.runner.group_kv import Blocks, gather_kv_heads, gather_layer_heads, scatter_kv_heads
from engine.parallel.layout import tp_layout
from engine.parallel.rank_service import RankServiceFactory
from engine.parallel.step_message import StepChannel, StepInputs
from engine.runner.process_ranks import ProcessLauncher
from engine.runner.tp_follower import FollowerSpec, status_key

logger = logging.getLogger("tandem.engine.tp")
STOP_WAIT_S = 10.0
POLL_S = 0.05


class FollowerRanks(Protocol):
    """The started follower ranks of one group (1..N-1), as a launcher runs them."""

    def exited(self, rank: int) -> str | None:
        """None while follower `rank` runs; once it ended, how (exit code, error)."""

    def stop(self, timeout_s: float) -> None:
        """Wait at most timeout_s for every follower to end, then kill those left; returns once all are gone.
        A follower ending after this was called is expected (not a loss). Idempotent."""


class FollowerLauncher(Protocol):
    """Starts a group's followers. own_resources: each follower gets a device (GPU, or CPU share) of its own
    from the launcher (spec.device and spec.num_threads are then the launcher's to set): rank 0 neither divides
    its cores nor checks this host's GPU count. children: the followers are child processes of rank 0 (they
    watch it as their parent; else by its pid)."""

    own_resources: bool
    children: bool

    def start(self, specs: list[FollowerSpec]) -> FollowerRanks:
        """Start one follower per spec (ranks 1..N-1; returns at once). Raises with nothing left running."""


class CopyRecordingKVCache(KVCache):
    """Rank 0's KV pool: block copies (forks) are done here and queued for the followers' next step."""

    def __init__(self, *args, leader: "TPLeader", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.leader = leader

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        super().copy_blocks(sources, targets)
        self.leader.queue_copies(sources, targets)


class TPLeader:
    """Rank 0 of a group of config.tensor_parallel_size ranks. Use start(); close() when the engine closes."""

    def __init__(self, group: TPGroup, store, followers: FollowerRanks, rendezvous: Rendezvous,
                 saved_threads: int) -> None:
        self.group, self.store, self.followers, self.rendezvous = group, store, followers, rendezvous
        self.channel = StepChannel(group)
        self.shard = self.model_config = self.pool = None  # set by start() / kv_cache()
        self._copies: tuple[list[int], list[int]] = ([], [])
        self._stream_blocks: list[int] = []
        self._lane_stream = False
        self.steps_sent = 0  # step messages sent so far: the next one's number (its followers count the same)
        self._saved_threads = saved_threads
        self._closed = False

    @property
    def processes(self) -> list:
        """The follower processes of the default launcher (rank 1 first); [] for another launcher's ranks."""
        return getattr(self.followers, "processes", [])

    @classmethod
    def start(cls, model: str, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype,
              device: torch.device, max_positions: int, launcher: FollowerLauncher | None = None,
              rank_service: RankServiceFactory | None = None) -> "TPLeader":
        """Start the followers (launcher: ProcessLauncher by default; each runs rank_service beside its steps when
        given) and connect the group (rank 0 = this process). With the default launcher on CPU the cores are
        divided among the ranks (torch's threads here too, restored by close). Any failure: the followers are
        killed, raised."""
        size, launcher = config.tensor_parallel_size, launcher or ProcessLauncher(config.tp_start_method)
        remove_stale_group_files()
        rendezvous = _rendezvous(private_store_path(), model_config, config, dtype, device)
        store = open_store(rendezvous)
        saved = torch.get_num_threads()
        threads = max(1, saved // size) if device.type == "cpu" and not launcher.own_resources else saved
        followers = None
        try:
            specs = [FollowerSpec(model, model_config, config, dtype, _rank_device(device, rank), rank, rendezvous,
                                  threads, os.getpid(), max_positions, leader_is_parent=launcher.children,
                                  rank_service=rank_service)
                     for rank in range(1, size)]
            followers = launcher.start(specs)
            _wait_for(store, rendezvous, followers, size, "alive", CONNECT_TIMEOUT_S)
            group = connect_group(store, rendezvous, 0, size, device,
                                  lambda: all(followers.exited(r) is None for r in range(1, size)))
        except BaseException:
            if followers is not None:
                followers.stop(0.0)
            remove_group_files(rendezvous)
            raise
        torch.set_num_threads(threads)
        leader = cls(group, store, followers, rendezvous, saved)
        leader.shard, leader.model_config = TPShard(tp_layout(model_config, 0, size), group), model_config
        logger.info("tensor parallel: %d ranks (pids %s), %d threads each", size, leader.pids(), threads)
        return leader

    def pids(self) -> list[int]:
        """Every rank's process id, rank 0 (this process) first (each follower reported its own)."""
        return [os.getpid()] + [int(self.store.get(status_key(self.rendezvous, "alive", rank)).decode())
                                for rank in range(1, self.group.size)]

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until every follower loaded its shard; ValueError with a follower's error (or death) otherwise.
        Every rank has mapped the shared memory file by then: its name is removed (nothing left to clean up)."""
        _wait_for(self.store, self.rendezvous, self.followers, self.group.size, "ready", timeout_s)
        _remove_shared_file(self.rendezvous)

    def kv_cache(self, spec: KVCacheSpec, num_blocks: int, device: torch.device, prefix_caching: bool) -> KVCache:
        """Rank 0's pool: its KV heads (TPLayout.kv_heads), as many blocks as every rank can hold (the smallest
        num_blocks of any rank: one collective, every rank), block copies forwarded to the followers."""
        self.pool = CopyRecordingKVCache(spec, self.group.min_int(num_blocks), device, prefix_caching,
                                         head_range=self.shard.layout.kv_heads, leader=self)
        return self.pool

    def gather_kv_heads(self, block_ids: list[int], out: torch.Tensor | None = None,
                        out_blocks: Blocks | None = None) -> torch.Tensor:
        """The KV of block_ids with every head of the model, from every rank's pool (engine/runner/group_kv.py):
        a new [L, 2, n, block_size, num_kv_heads, head_dim], or written straight into blocks out_blocks of the
        full-head pool out (returned; nothing else of it changes). Call it on the thread that steps the engine."""
        copies, self._copies = self._copies, ([], [])
        return gather_kv_heads(self.channel, self.pool, self.model_config, block_ids, copies, out, out_blocks)

    def scatter_kv_heads(self, block_ids: list[int], full: torch.Tensor, full_blocks: Blocks | None = None) -> None:
        """Write full's heads ([L, 2, n, ...], or blocks full_blocks of the full-head pool full) into block_ids of
        every rank's pool, each rank its own; full is unchanged. On the stepping thread."""
        copies, self._copies = self._copies, ([], [])
        scatter_kv_heads(self.channel, self.pool, self.model_config, block_ids, full, copies, full_blocks)

    def queue_copies(self, sources: list[int], targets: list[int]) -> None:
        self._copies[0].extend(sources)
        self._copies[1].extend(targets)

    def stream_next_step(self, block_ids: list[int]) -> torch.Tensor:
        """The next step gathers every layer of block_ids to rank 0 as its forward writes it: call gather_layer
        (block ids as returned here, on the pool's device) from that forward's layer callback, every layer."""
        self._stream_blocks = list(block_ids)
        return torch.tensor(self._stream_blocks, dtype=torch.long, device=self.pool.kv.device)

    def gather_layer(self, layer: int, ids: torch.Tensor, out: torch.Tensor | None = None,
                     out_blocks: Blocks | None = None) -> torch.Tensor:
        """Layer `layer` of the streamed blocks with every head: a new [2, n, block_size, num_kv_heads, head_dim],
        or written straight into blocks out_blocks of out (one layer of a full-head pool, returned)."""
        return gather_layer_heads(self.group, self.pool, self.model_config, layer, ids, out, out_blocks)

    def stream_lanes_next_step(self) -> None:
        """Every follower reports each layer of the next step's forward (number steps_sent) to its rank service
        (KV lanes streaming from every rank: RankService.layer_done)."""
        self._lane_stream = True

    def send_step(self, step: StepInputs) -> None:
        """Send the step (with the block copies queued since the last one, and the blocks it streams) to every
        follower: one message."""
        if self._copies[0]:
            step, self._copies = replace(step, copies=self._copies), ([], [])
        if self._stream_blocks:
            step, self._stream_blocks = replace(step, stream_blocks=self._stream_blocks), []
        if self._lane_stream:
            step, self._lane_stream = replace(step, lane_stream=True), False
        self.channel.send(step)
        self.steps_sent += 1

    def abort(self) -> None:
        """A failed start: kill the followers at once (they may be inside a collective), restore the threads."""
        self._closed = True
        self.followers.stop(0.0)
        remove_group_files(self.rendezvous)
        torch.set_num_threads(self._saved_threads)

    def close(self) -> None:
        """Stop every follower (STOP message, then a kill past STOP_WAIT_S), remove the group's files and restore
        torch's threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if all(self.followers.exited(rank) is None for rank in range(1, self.group.size)):
                self.channel.send_stop()
        except Exception as exc:  # noqa: BLE001 - a follower already gone: the kill below still runs
            logger.warning("tensor parallel: STOP not delivered (%s); killing the followers", exc)
        self.followers.stop(STOP_WAIT_S)
        remove_group_files(self.rendezvous)
        torch.set_num_threads(self._saved_threads)


def _wait_for(store, rendezvous: Rendezvous, followers: FollowerRanks, size: int, what: str,
              timeout_s: float) -> None:
    """Until every follower set its `what` key; ValueError when one set its error key, ended, or the time ran out."""
    pending, deadline = set(range(1, size)), time.monotonic() + timeout_s
    while pending:
        for rank in sorted(pending):
            if store.check([status_key(rendezvous, "error", rank)]):
                error = store.get(status_key(rendezvous, "error", rank)).decode()
                raise ValueError(f"tensor-parallel rank {rank} failed to start:\n{error}")
            if store.check([status_key(rendezvous, what, rank)]):
                pending.discard(rank)
            elif (how := followers.exited(rank)) is not None:
                raise ValueError(f"tensor-parallel rank {rank} {how} before it was {what}")
        if pending and time.monotonic() > deadline:
            raise ValueError(f"tensor-parallel ranks {sorted(pending)} not {what} after {timeout_s:.0f} s")
        time.sleep(POLL_S if pending else 0)


def _rank_device(device: torch.device, rank: int) -> str:
    """Where the default launcher's follower `rank` runs: the CPU, or the GPU rank places after rank 0's. A
    launcher of its own resources sets its followers' devices itself."""
    return "cpu" if device.type == "cpu" else f"cuda:{(device.index or 0) + rank}"


def _rendezvous(store_path: str, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype,
                device: torch.device) -> Rendezvous:
    """The group's rendezvous; on CPU with the shared memory file of its all-reduces (created here), whose slot
    holds a step's largest all-reduce: max_num_batched_tokens x hidden_size (capped; larger ones use gloo)."""
    namespace = f"tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    if device.type != "cpu" or config.tp_cpu_all_reduce == "gloo":
        return Rendezvous(store_path, namespace)
    element = torch.tensor([], dtype=dtype).element_size()
    slot = min(MAX_SLOT_BYTES, config.max_num_batched_tokens * model_config.hidden_size * element)
    path = shared_memory_dir() / f"tandem-{namespace}"
    create_file(path, config.tensor_parallel_size, slot)
    return Rendezvous(store_path, namespace, shm_path=str(path), shm_slot_bytes=slot)


def _remove_shared_file(rendezvous: Rendezvous) -> None:
    if rendezvous.shm_path:
        Path(rendezvous.shm_path).unlink(missing_ok=True)
