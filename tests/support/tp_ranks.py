"""Run a function on every rank of a real gloo tensor-parallel group: one spawned process per rank, rendezvous at
a FileStore in a private directory. Results (or the rank's error) come back over a queue,
pickled by value in the rank (a queue would share tensors by file descriptor, gone once the rank exits)."""
from __future__ import annotations

import pickle
import queue
import traceback

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions for the queues)

from engine.parallel.group import Rendezvous, connect_group, open_store
from engine.parallel.group_files import private_store_path, remove_store
from tests.support.child_processes import child_context

RANK_TIMEOUT_S = 120.0


def _rank_main(fn, rank: int, size: int, rendezvous: Rendezvous, results, args) -> None:
    try:
        torch.set_num_threads(1)
        group = connect_group(open_store(rendezvous), rendezvous, rank, size, torch.device("cpu"))
        results.put((rank, "ok", pickle.dumps(fn(group, *args))))
    except BaseException:  # noqa: BLE001 - the test process reports it
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, size: int, *args) -> list:
    """fn(group, *args) on each of `size` ranks (fn importable at module level); its results in rank order.
    AssertionError with the traceback if any rank raised; every process is joined (killed past the timeout)."""
    rendezvous = Rendezvous(private_store_path(), "test")
    context = child_context()
    results = context.Queue()
    processes = [context.Process(target=_rank_main, args=(fn, r, size, rendezvous, results, args), daemon=True)
                 for r in range(size)]
    for process in processes:
        process.start()
    got = {}
    try:
        for _ in range(size):
            rank, status, value = results.get(timeout=RANK_TIMEOUT_S)
            assert status == "ok", f"rank {rank} failed:\n{value}"
            got[rank] = pickle.loads(value)
    except queue.Empty as exc:
        raise AssertionError(f"ranks {sorted(set(range(size)) - set(got))} gave no result") from exc
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        remove_store(rendezvous.store_path)
    return [got[r] for r in range(size)]


def _serve_rank(rank: int, size: int, rendezvous: Rendezvous, tasks, results) -> None:
    """A rank of a RankGroup: connects once, then runs each pickled (fn, args) it is sent until it is sent None."""
    try:
        torch.set_num_threads(1)
        group = connect_group(open_store(rendezvous), rendezvous, rank, size, torch.device("cpu"))
    except BaseException:  # noqa: BLE001 - the test process reports it
        results.put((rank, "error", traceback.format_exc()))
        return
    while (task := tasks.get()) is not None:
        try:
            fn, args = pickle.loads(task)
            results.put((rank, "ok", pickle.dumps(fn(group, *args))))
        except BaseException:  # noqa: BLE001
            results.put((rank, "error", traceback.format_exc()))


class RankGroup:
    """`size` spawned ranks of one real gloo group, started once and kept for many `run` calls (a module's tests
    share the start-up: a spawned rank imports torch and the engine). Each call behaves as run_ranks: fn(group,
    *args) on every rank, results in rank order, AssertionError with the traceback if a rank raised; after a
    failure the group is closed (its ranks may be stuck in a collective) and `closed` is True."""

    def __init__(self, size: int) -> None:
        self.size, self.closed = size, False
        self.rendezvous = Rendezvous(private_store_path(), "test")
        context = child_context()
        self.results = context.Queue()
        self.tasks = [context.Queue() for _ in range(size)]
        self.processes = [context.Process(target=_serve_rank, args=(r, size, self.rendezvous, self.tasks[r],
                                                                     self.results), daemon=True)
                          for r in range(size)]
        for process in self.processes:
            process.start()

    def run(self, fn, *args) -> list:
        assert not self.closed, "this rank group was closed"
        task = pickle.dumps((fn, args))  # by value, as run_ranks sends them
        for tasks in self.tasks:
            tasks.put(task)
        got = {}
        try:
            for _ in range(self.size):
                rank, status, value = self.results.get(timeout=RANK_TIMEOUT_S)
                assert status == "ok", f"rank {rank} failed:\n{value}"
                got[rank] = pickle.loads(value)
        except BaseException as exc:
            self.close()
            if isinstance(exc, queue.Empty):
                raise AssertionError(f"ranks {sorted(set(range(self.size)) - set(got))} gave no result") from exc
            raise
        return [got[r] for r in range(self.size)]

    def close(self) -> None:
        """Stops every rank (killed past a timeout) and removes the group's store."""
        if self.closed:
            return
        self.closed = True
        for tasks in self.tasks:
            tasks.put(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        remove_store(self.rendezvous.store_path)
