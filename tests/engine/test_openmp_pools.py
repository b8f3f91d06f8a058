"""The thread that built an engine gives its OpenMP workers back (engine/runner/openmp_pools.py)."""
import subprocess
import sys

import pytest

from engine.runner.openmp_pools import _loaded_openmp_runtimes

# A thread runs parallel work (its OpenMP pool: 2 workers besides itself), then releases the pool; prints the
# process's thread count before and after, and what the call returned.
POOL = """
import os, time, torch
from engine.runner.openmp_pools import release_openmp_pool
torch.set_num_threads(3)
torch.randn(512, 512) @ torch.randn(512, 512)
before = len(os.listdir("/proc/self/task"))
released = release_openmp_pool()
time.sleep(0.5)
after = len(os.listdir("/proc/self/task"))
torch.randn(512, 512) @ torch.randn(512, 512)   # parallel work again: a new pool, the same result
print(before, after, released)
"""


def test_the_openmp_runtime_torch_uses_is_found():
    import torch
    torch.randn(256, 256) @ torch.randn(256, 256)
    if not any("gomp" in path or "omp" in path for path in _loaded_openmp_runtimes()):
        pytest.skip("this torch build runs no OpenMP runtime of its own")
    assert all(path.startswith("/") for path in _loaded_openmp_runtimes())


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/task")
def test_releasing_the_pool_ends_its_worker_threads():
    out = subprocess.run([sys.executable, "-c", POOL], capture_output=True, text=True, check=True)
    before, after, released = map(int, out.stdout.split())
    if released == 0:
        pytest.skip("no OpenMP runtime with omp_pause_resource_all in this process")
    assert after <= before - 2          # both workers of the pool are gone


def test_an_engine_loop_releases_the_building_threads_pool(tmp_path, monkeypatch):
    import cluster.local.engine_loop as engine_loop
    import engine.runner.openmp_pools as openmp_pools
    from tests.support.engines import make_llm
    from tests.support.factories import make_checkpoint
    calls = []
    monkeypatch.setattr(openmp_pools, "release_openmp_pool", lambda: calls.append("released") or 1)
    with make_llm(str(make_checkpoint(tmp_path, "llama")), device="cpu") as llm:
        loop = engine_loop.EngineLoop(llm.engine, "test")
        loop.stop()
    assert calls == ["released"]
