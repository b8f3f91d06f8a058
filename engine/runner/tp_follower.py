"""A follower rank: a process that holds its shard of the model and of the KV pool, and runs, for every step rank 0
sends (engine/parallel/step_message.py), the same forward and the same logits calls (their collectives meet
rank 0's). It schedules nothing and samples nothing: its KV pool's blocks are the ones rank 0's allocator hands
out, with this rank's KV heads (TPLayout.kv_heads) in them.

follower_main is the rank's entry point: of a process tp_leader.py spawned, or of a Ray actor of a serving worker's
group (cluster/workers/tp_group.py; FollowerSpec.leader_is_parent False: rank 0 is another process of the same
node, not the parent). It ends on rank 0's STOP message, on any error (logged), or when rank 0's process is gone
(a watchdog thread: no rank outlives it).
"""
from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import select_backend
from engine.config import EngineConfig, ModelConfig, max_model_len
from engine.kv.kv_cache import KVCache, KVCacheSpec
from engine.model.causal_lm import CausalLM
from engine.model.tp_layers import TPShard
from engine.model.tp_weights import load_shard
from engine.parallel.group import Rendezvous, TPGroup, connect_group, open_store
from engine.parallel.group_files import process_alive, remove_group_files
from engine.parallel.layout import tp_layout
from engine.parallel.rank_service import RankContext, RankServiceFactory
from engine.runner.group_kv import gather_layer_heads, run_kv_move
from engine.parallel.step_message import KVMove, StepChannel, StepInputs
from engine.runner.decode_graphs import decode_graphs_for
from engine.runner.follower_inputs import FollowerInputs
from engine.runner.host_malloc import keep_freed_host_memory
from engine.runner.memory_plan import plan_memory
from engine.sampling.prompt_logprobs import ROWS_PER_SLICE
from engine.step_io import StepIO

logger = logging.getLogger("tandem.engine.tp")
PARENT_POLL_S = 0.2
LEADER_EXIT_WAIT_S = 2.0  # a broken group: how long rank 0's process may take to be gone (then: the store removed)


@dataclass(frozen=True)
class FollowerSpec:
    """What a follower process is started with (pickled into it)."""

    model: str                # resolved: "tiny", a GGUF file or a checkpoint directory
    model_config: ModelConfig
    config: EngineConfig
    dtype: torch.dtype
    device: str               # "cpu" or "cuda:<rank>"
    rank: int
    rendezvous: Rendezvous
    num_threads: int          # torch's intra-op threads (CPU: the cores divided among the ranks)
    parent_pid: int           # rank 0's process
    max_positions: int
    leader_is_parent: bool = True  # False: rank 0 is not this process's parent (a Ray actor, a fork server's child)
    rank_service: RankServiceFactory | None = None  # started beside the steps (engine/parallel/rank_service.py)


def leader_alive(spec: FollowerSpec) -> bool:
    """Whether rank 0's process still runs (the ranks of a group share a host, so its pid is visible here)."""
    if spec.leader_is_parent:
        return os.getppid() == spec.parent_pid
    return process_alive(spec.parent_pid)  # a killed rank 0 may stay a zombie until Ray's raylet reaps it


def status_key(rendezvous: Rendezvous, what: str, rank: int) -> str:
    """The store key a follower sets at a milestone ("alive", "ready", "error")."""
    return f"{rendezvous.namespace}/{what}/{rank}"


class FollowerRunner:
    """The follower's half of ModelRunner.launch: the same forward (eager or a decode graph's replay) and the same
    logits calls, its inputs staged in one upload as rank 0 stages its own (engine/runner/follower_inputs.py)."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, inputs: FollowerInputs, group: TPGroup | None,
                 model_config: ModelConfig) -> None:
        """inputs: stages the steps (its io counts the copies; its graphs replay decode steps). group: the
        rank's group (streamed blocks go to rank 0 over it); None where no step streams (one-rank tests)."""
        self.model, self.kv_cache, self.inputs = model, kv_cache, inputs
        self.group, self.model_config = group, model_config

    @property
    def io(self) -> StepIO:
        """The follower's StepIO: io.copies counts each step's host <-> device copies."""
        return self.inputs.io

    @torch.inference_mode()
    def run(self, step: StepInputs, on_layer: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """Run one step rank 0 sent: its queued block copies, the forward (writes the step's K/V into this rank's
        pool; streamed blocks' layers gathered to rank 0; on_layer(l) after each layer l when given) and the logits
        calls rank 0 makes (prompt-logprob slices, then the sampled rows). Returns the sampled rows' logits
        [S, vocab] where this rank gets them (a one-rank model), else None."""
        if step.copies[0]:  # forks copied blocks on rank 0 after its last forward: the same here, before this one
            self.kv_cache.copy_blocks(list(step.copies[0]), list(step.copies[1]))
        staged = self.inputs.stage(step)  # the step's one upload (a graphed step's: in run_staged)
        if staged.graph is not None:
            tables = self.inputs.tables.device_tables
            hidden, sample_rows = self.inputs.graphs.run_staged(staged.graph, tables)  # [B, hidden], [S]
        else:
            hidden = self.model(staged.input_ids, staged.positions, staged.meta, self.kv_cache,
                                self._layer_hook(staged.streamed, on_layer))  # [T, hidden]
            sample_rows = staged.sample_rows  # [S]
        for begin in range(0, len(step.prompt_rows), ROWS_PER_SLICE):  # as compute_prompt_logprobs slices them
            rows = staged.prompt_rows[begin:begin + ROWS_PER_SLICE]  # [r]
            self.model.compute_logits(hidden.index_select(0, rows))
        if not step.sample_rows:
            return None
        return self.model.compute_logits(hidden.index_select(0, sample_rows))  # [S, hidden] -> [S, vocab] | None

    def _layer_hook(self, streamed: torch.Tensor | None, on_layer: Callable[[int], None] | None):
        """The forward's layer callback of a step that streams blocks ([B] on the device) to rank 0 (their layer,
        gathered) or reports its layers (on_layer); else None."""
        if streamed is None:
            return on_layer

        def gather(layer: int) -> None:
            gather_layer_heads(self.group, self.kv_cache, self.model_config, layer, streamed)
            if on_layer is not None:
                on_layer(layer)

        return gather

    def close(self) -> None:
        if self.inputs.graphs is not None:
            self.inputs.graphs.close()
        self.model = self.kv_cache = self.inputs.graphs = None


def build_follower_runner(spec: FollowerSpec, model: CausalLM, group: TPGroup, kv_heads: tuple[int, int],
                          device: torch.device) -> FollowerRunner:
    """The follower's KV pool and decode graphs, sized as rank 0 sizes its own (LLMEngine): the smallest block
    count any rank can hold (one collective)."""
    cfg, config = spec.model_config, spec.config
    attention = select_backend(config.attention_backend, device, spec.dtype)
    kv_spec = KVCacheSpec(cfg.num_layers, kv_heads[1] - kv_heads[0], cfg.head_dim, config.block_size, spec.dtype)
    num_blocks = group.min_int(plan_memory(model, kv_spec, config, device, attention).num_blocks)
    kv_cache = KVCache(kv_spec, num_blocks, device, enable_prefix_caching=False, head_range=kv_heads)
    if config.kv_cache_resident:
        kv_cache.commit_host_pages()
    io = StepIO(device)
    graphs = decode_graphs_for(model, kv_cache, attention, config, max_model_len(cfg, config, num_blocks), device,
                               io=io)
    inputs = FollowerInputs(attention, config.block_size, device, io, graphs, num_rows=config.max_num_seqs)
    return FollowerRunner(model, kv_cache, inputs, group, cfg)


def follower_main(spec: FollowerSpec) -> None:
    """A follower process: connect, load this rank's shard, report ready (or the error), then run steps."""
    _watch_parent(spec)
    torch.set_num_threads(spec.num_threads)
    rendezvous, size = spec.rendezvous, spec.config.tensor_parallel_size
    store = open_store(rendezvous)
    store.set(status_key(rendezvous, "alive", spec.rank), str(os.getpid()).encode())  # the value: this pid
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_host_memory()
    try:
        group = connect_group(store, rendezvous, spec.rank, size, device, lambda: leader_alive(spec))
        layout = tp_layout(spec.model_config, spec.rank, size)
        model = load_shard(spec.model, spec.model_config, TPShard(layout, group), spec.dtype, device,
                           spec.max_positions)
    except BaseException:  # noqa: BLE001 - rank 0 raises it for us
        store.set(status_key(rendezvous, "error", spec.rank), traceback.format_exc().encode())
        return
    store.set(status_key(rendezvous, "ready", spec.rank), b"1")
    service = None
    try:
        runner = build_follower_runner(spec, model, group, layout.kv_heads, device)
        if spec.rank_service is not None:
            service = spec.rank_service(RankContext(spec.rank, size, runner.kv_cache.kv, layout.kv_heads))
        channel, steps = StepChannel(group), 0
        while (message := channel.receive()) is not None:
            if isinstance(message, KVMove):
                run_kv_move(message, group, runner.kv_cache, spec.model_config)
            else:
                runner.run(message, _layers_to(service, steps) if message.lane_stream else None)
                steps += 1
        runner.close()
    except RuntimeError as exc:  # rank 0's group is gone (its engine dropped unclosed, or its process died)
        logger.warning("tensor-parallel rank %d stops: rank 0 is gone (%s)", spec.rank, str(exc).splitlines()[0])
        _wait_leader_gone(spec, LEADER_EXIT_WAIT_S)  # its sockets close before its process is gone
    except BaseException:  # noqa: BLE001 - a failed step: nothing to run for any more
        logger.error("tensor-parallel rank %d stops: %s", spec.rank, traceback.format_exc())
    finally:
        if service is not None:
            service.close()
        if not leader_alive(spec):  # rank 0 died: nobody else removes the group's files
            remove_group_files(rendezvous)


def _layers_to(service, step: int) -> Callable[[int], None] | None:
    """The layer callback that reports step `step`'s layers to the rank service (None without one)."""
    return None if service is None else (lambda layer: service.layer_done(step, layer))


def _wait_leader_gone(spec: FollowerSpec, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while leader_alive(spec) and time.monotonic() < deadline:
        time.sleep(0.01)


def _watch_parent(spec: FollowerSpec) -> None:
    """Exit at once when rank 0's process is gone (killed: it could not send STOP or remove the group's files,
    which this rank then removes)."""
    def watch() -> None:
        while leader_alive(spec):
            time.sleep(PARENT_POLL_S)
        remove_group_files(spec.rendezvous)
        os._exit(1)

    threading.Thread(target=watch, name="tandem-tp-parent-watch", daemon=True).start()
