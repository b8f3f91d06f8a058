"""The context the tests start their child processes from (transfer peers, tensor-parallel ranks): a fork server
that imported torch and Tandem's packages once.

A spawned child imports torch afresh, ~2.5 s of CPU on the 2-core CI machine, and the suite starts ~70 of them; a
child forked from the server starts with those modules imported. Each child still gets its target and arguments
pickled, as under spawn, and a fresh process whose only thread runs the target. The server is started by the first
child of each test process and ends with it."""
from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import BaseContext

from engine.runner.process_ranks import FORKSERVER_PRELOAD

# A process has one fork server, shared with the TP engines the tests build (EngineConfig.tp_start_method
# "forkserver"), and it imports its list once, when the first child of either kind starts it: the engine's, and more.
PRELOADED = (*FORKSERVER_PRELOAD, "numpy", "grpc", "kv_transfer")

# The engine option that starts a TP engine's follower ranks from that same fork server.
FORKED_RANKS = dict(tp_start_method="forkserver")


def child_context() -> BaseContext:
    """A multiprocessing context whose children fork from a server that has PRELOADED imported."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    return context
