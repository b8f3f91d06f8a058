"""The default way a tensor-parallel group's followers start (engine/runner/tp_leader.py FollowerLauncher): each one a
child process of rank 0's (daemon; spawned, or forked from multiprocessing's fork server: EngineConfig.tp_start_method),
stopped by a bounded join and then a kill."""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback

import torch.multiprocessing as mp

from engine.runner.tp_follower import FollowerSpec, follower_main


class ProcessRanks:
    """FollowerRanks of spawned child processes (`processes`: rank 1 first)."""

    def __init__(self, processes: list) -> None:
        self.processes = processes

    def exited(self, rank: int) -> str | None:
        process = self.processes[rank - 1]
        return None if process.is_alive() else f"exited (code {process.exitcode})"

    def stop(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        _kill(self.processes)


# What the fork server imports once, before it forks the followers: all a follower's step needs.
FORKSERVER_PRELOAD = ("torch", "engine", "engine.runner.tp_follower")


class ProcessLauncher:
    """The default launcher: each follower a child process of this one (daemon), started by `start_method`
    ("spawn" or "forkserver"). Forked from the fork server, a follower's parent is that server, not rank 0
    (children False: it watches rank 0 by pid)."""

    own_resources = False

    def __init__(self, start_method: str = "spawn") -> None:
        self.start_method = start_method
        self.children = start_method == "spawn"

    def start(self, specs: list[FollowerSpec]) -> ProcessRanks:
        context, processes = mp.get_context(self.start_method), []
        if self.start_method == "forkserver":
            context.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        try:
            for spec in specs:
                process = context.Process(target=_follower_process, args=(spec,), daemon=True,
                                          name=f"tandem-tp-rank{spec.rank}")
                process.start()
                processes.append(process)
        except BaseException:
            _kill(processes)
            raise
        return ProcessRanks(processes)


def _follower_process(spec: FollowerSpec) -> None:
    """A spawned follower: follower_main, then the process ends at once. follower_main has released what the group
    shares (its files, its service) by then; the interpreter's own teardown of torch and the process group would
    add ~0.75 s to every engine's close() here, and nothing in it is needed."""
    code = 1
    try:
        follower_main(spec)
        code = 0
    except BaseException:  # noqa: BLE001 - reported as the process would report it, with its exit code
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _kill(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
