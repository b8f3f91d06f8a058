"""A worker that is a tensor-parallel group on Ray: rank 0 is the worker's actor (PrefillActor / DecodeActor,
which holds the engine and answers the coordinator), ranks 1..N-1 are TPRankActors in the same placement
group, rank r in bundle r (the group's bundles STRICT_PACKed on one node: cluster/workers/tp_placement.py).

    engine = build_group_engine(spec)      # in the rank-0 actor, when spec.engine.tensor_parallel_size > 1

The rank-0 actor starts its followers itself (RayRankLauncher), so it owns them: Ray ends them when it dies or
is killed (the coordinator's ray.kill of a lost worker, release at shutdown). The ranks meet through a FileStore
in a private directory of their node and one gloo group on 127.0.0.1 (NCCL for the tensors on GPUs), exactly as
the engine's own follower processes do (engine/runner/tp_leader.py); each step's inputs go from rank 0 to the
others in one message over that group. A follower that ends while the worker serves takes the worker with it:
rank 0's process exits at once, so the coordinator sees a worker death (its requests migrate) and Ray ends the
other ranks.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.parallel.group_files import remove_group_files
from engine.runner.tp_follower import FollowerSpec, follower_main

logger = logging.getLogger("tandem.cluster.tp_group")


@ray.remote(max_restarts=0)
class TPRankActor:
    """Follower rank of a worker's tensor-parallel group: holds its shards of the model and of the KV pool and
    runs the forward of every step rank 0 sends, until rank 0's STOP (run() then returns)."""

    def __init__(self, spec: FollowerSpec) -> None:
        self._spec = spec

    def run(self) -> None:
        """The rank's whole life (engine/runner/tp_follower.py follower_main): returns once it ended."""
        follower_main(self._spec)


class RayRanks:
    """FollowerRanks (engine/runner/tp_leader.py) of TPRankActors. A watcher thread waits on every rank's run()
    call; one that ends before stop() was called is a lost rank: on_lost(rank, how) (the worker's end)."""

    def __init__(self, actors: list, on_lost) -> None:
        self._actors, self._on_lost = actors, on_lost
        self._runs = {actor.run.remote(): rank for rank, actor in enumerate(actors, start=1)}
        self._ended: dict[int, str] = {}
        self._stopping, self._all_ended = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, name="tandem-tp-ranks", daemon=True)
        self._watcher.start()

    def exited(self, rank: int) -> str | None:
        with self._lock:
            return self._ended.get(rank)

    def stop(self, timeout_s: float) -> None:
        """Every rank's run() ended (STOP) within timeout_s, or its actor is killed."""
        self._stopping.set()
        self._all_ended.wait(timeout_s)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._watcher.join(timeout=max(timeout_s, 1.0))

    def _watch(self) -> None:
        pending = list(self._runs)
        while pending:
            try:
                done, pending = ray.wait(pending, num_returns=1)
            except Exception as error:  # noqa: BLE001 - this process leaves Ray (it is going away)
                logger.warning("tensor-parallel ranks: no longer watched (%s)", error)
                return
            for ref in done:
                lost = not self._stopping.is_set()
                rank, how = self._runs[ref], _how_it_ended(ref) if lost else "stopped"
                with self._lock:
                    self._ended[rank] = how
                if lost:
                    self._on_lost(rank, how)
        self._all_ended.set()


def _how_it_ended(ref) -> str:
    try:
        ray.get(ref, timeout=0)
    except Exception as error:  # noqa: BLE001 - the actor died (killed, crashed): say how
        return f"ended: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    return "returned (stopped)"


class RayRankLauncher:
    """FollowerLauncher (engine/runner/tp_leader.py) of a worker's group on Ray: follower rank r in bundle r of
    the placement group this actor runs in, with that bundle's CPUs and GPU (own_resources: on a GPU Ray makes
    the bundle's GPU the actor's cuda:0; on CPU the rank runs with its bundle's threads)."""

    own_resources = True
    children = False

    def __init__(self, on_lost) -> None:
        self._on_lost = on_lost

    def start(self, specs: list[FollowerSpec]) -> RayRanks:
        group = get_current_placement_group()
        size = len(specs) + 1
        if group is None or len(group.bundle_specs) != size:
            raise ValueError(f"a tensor-parallel worker of {size} ranks runs in a placement group of its own with "
                             f"one bundle per rank (this actor's: {None if group is None else group.bundle_specs})")
        actors = []
        try:
            for spec in specs:
                bundle = group.bundle_specs[spec.rank]
                device = "cpu" if spec.device == "cpu" else "cuda:0"
                threads = max(1, int(bundle.get("CPU", 1)))
                strategy = PlacementGroupSchedulingStrategy(placement_group=group,
                                                            placement_group_bundle_index=spec.rank)
                actors.append(TPRankActor.options(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                                                  scheduling_strategy=strategy)
                              .remote(dataclasses.replace(spec, device=device, num_threads=threads)))
            return RayRanks(actors, self._on_lost)
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            raise


def exit_worker(reason: str) -> None:
    """The worker is gone with a rank (one ended, or a step's collective failed: the ranks diverged). This process
    (rank 0) exits at once, so the coordinator sees a worker death and moves its requests (no request is ended
    with an error first); Ray then ends the ranks it owned."""
    logger.error("tensor-parallel worker (rank 0, pid %d) ends: %s", os.getpid(), reason)
    logging.shutdown()
    os._exit(1)


def build_group_engine(spec, on_lost=exit_worker, rank_service=None):
    """The engine of a tensor-parallel worker (spec: cluster/workers/actors.py EngineSpec, with
    engine.tensor_parallel_size > 1), this actor being rank 0 and its followers TPRankActors, each running
    rank_service beside its steps when given (its KV lane: kv_transfer/lanes/). ValueError (no rank left running)
    when the model does not split or a rank fails to start (its error, not this actor's exit: on_lost(reason)
    applies from the moment the engine is built, after the group's files are removed)."""
    armed: list = []  # the group's rendezvous, once the engine is built

    def lost(rank: int, how: str) -> None:
        if armed:  # rank 0 ends now: nobody else would remove the group's files
            remove_group_files(armed[0])
            on_lost(f"its rank {rank} {how}")

    engine = _build(spec, lost, rank_service)
    armed.append(engine.tp_leader.rendezvous)
    followers = engine.tp_leader.followers
    for rank in range(1, engine.config.tensor_parallel_size):  # one that ended before the arming
        if (how := followers.exited(rank)) is not None:
            lost(rank, how)
    return engine


def step_failure_exit(engine, on_lost=exit_worker):
    """The decode worker's on_step_failure for a group engine: a failed step (a rank died under a collective) is
    the worker's end, as a lost rank is."""
    rendezvous = engine.tp_leader.rendezvous

    def failed(error: BaseException) -> None:
        remove_group_files(rendezvous)
        on_lost(f"an engine step failed: {error}")

    return failed


def _build(spec, on_lost, rank_service):
    from engine.builder import build_engine

    return build_engine(spec.model, spec.engine, spec.dtype, spec.device, spec.tokenizer, RayRankLauncher(on_lost),
                        rank_service)
