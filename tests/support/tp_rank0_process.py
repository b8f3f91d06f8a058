"""A process that is rank 0 of a TP=2 engine of the embedded model and never closes it: prints its followers' pids
(one JSON line), then waits to be killed (tests/engine/test_tensor_parallel.py kills it with SIGKILL). argv[1]: the
followers' start method (EngineConfig.tp_start_method)."""
from __future__ import annotations

import json
import sys
import time

from engine import LLM

if __name__ == "__main__":
    llm = LLM("tiny", device="cpu", tensor_parallel_size=2, tp_start_method=sys.argv[1])
    print(json.dumps([p.pid for p in llm.engine.tp_leader.processes]), flush=True)
    while True:
        time.sleep(1)
        sys.stdout.flush()
