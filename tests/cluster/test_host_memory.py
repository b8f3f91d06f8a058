"""CPU KV pools sized from the host's available memory (cluster/workers/host_memory.py), on fake readings, and
the lazily zeroed pool they go into."""
from __future__ import annotations

import pytest
import torch

from cluster.workers.host_memory import CPU_KV_MEMORY_FRACTION, available_host_memory, cpu_kv_share
from engine.kv.kv_cache import zeroed_pool

GIB = 1 << 30


def test_the_available_memory_is_shared_evenly_among_the_engines_on_the_host():
    share = cpu_kv_share(None, engines=2, read_available=lambda: 10 * GIB)
    assert share.bytes_per_engine == int(CPU_KV_MEMORY_FRACTION * 10 * GIB) // 2
    assert not share.explicit
    assert "per engine x 2 engine(s)" in share.describe() and "10.00 GiB available" in share.describe()
    assert cpu_kv_share(None, engines=1, read_available=lambda: 10 * GIB).bytes_per_engine == 2 * share.bytes_per_engine


def test_an_explicit_size_wins_unless_the_engines_would_need_more_than_is_available():
    share = cpu_kv_share(3 * GIB, engines=3, read_available=lambda: 10 * GIB)
    assert (share.bytes_per_engine, share.explicit) == (3 * GIB, True)
    with pytest.raises(ValueError, match=r"--kv-cache-memory-mib 4096 x 3 engine\(s\).*give at most 3413"):
        cpu_kv_share(4 * GIB, engines=3, read_available=lambda: 10 * GIB)


def test_a_host_short_of_memory_is_refused_at_start():
    with pytest.raises(ValueError, match="start fewer workers"):
        cpu_kv_share(None, engines=8, read_available=lambda: GIB)


def test_the_available_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24731724 kB\nMemFree:        20000000 kB\nMemAvailable:   21000000 kB\n")
    assert available_host_memory(meminfo) == 21000000 * 1024
    meminfo.write_text("MemTotal:       24731724 kB\n")
    with pytest.raises(ValueError, match="MemAvailable"):
        available_host_memory(meminfo)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_pool_is_zeroed_contiguous_and_writable(dtype):
    pool = zeroed_pool((2, 2, 64, 16, 3, 8), dtype, torch.device("cpu"))  # [L, 2, blocks, block, H_kv, D]
    assert pool.dtype == dtype and pool.shape == (2, 2, 64, 16, 3, 8) and pool.is_contiguous()
    assert not pool.any()
    pool[1, 0, 63] = 1.5
    assert float(pool.sum()) == 1.5 * 16 * 3 * 8


def test_a_local_cluster_gives_each_cpu_worker_its_share_of_the_host(monkeypatch):
    from cluster.workers import host_memory
    from cluster.workers.cluster_config import ClusterConfig
    from cluster.workers.launch import with_cpu_kv_share
    from engine import EngineConfig
    monkeypatch.setattr(host_memory, "available_host_memory", lambda: 10 * GIB)
    config = with_cpu_kv_share(ClusterConfig(num_prefill_workers=1, num_decode_workers=1, engine=EngineConfig()))
    assert config.engine.kv_cache_memory == int(CPU_KV_MEMORY_FRACTION * 10 * GIB) // 2
    asked = ClusterConfig(num_prefill_workers=1, num_decode_workers=1, engine=EngineConfig(kv_cache_memory=6 * GIB))
    with pytest.raises(ValueError, match="more than the 10.00 GiB available"):
        with_cpu_kv_share(asked)
