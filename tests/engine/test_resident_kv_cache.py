"""A CPU KV pool is committed page by page as written, or all at start when kv_cache_resident asks
(engine/kv/host_pages.py); residency is read back from the kernel with mincore(2)."""
import argparse
import ctypes
import mmap
import sys

import numpy as np
import pytest
import torch

from engine import EngineConfig
from engine.kv import host_pages
from engine.kv.kv_cache import KVCache, KVCacheSpec
from tests.support.engine_checks import assert_all_blocks_free
from tests.support.engines import make_llm
from tests.support.factories import make_checkpoint

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and MADV_POPULATE_WRITE")


def resident_pages(array: np.ndarray) -> tuple[int, int]:
    """(pages of array's memory the kernel holds, pages it spans); array starts on a page."""
    assert array.ctypes.data % mmap.PAGESIZE == 0
    pages = -(-array.nbytes // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(array.ctypes.data, array.nbytes, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector), pages


def pool_bytes(kv_cache: KVCache) -> np.ndarray:
    return kv_cache.kv.view(-1).view(torch.uint8).numpy()


@linux_only
def test_host_bytes_are_zero_and_committed_only_where_written():
    memory = host_pages.zeroed_host_bytes(64 * mmap.PAGESIZE)
    assert memory.ctypes.data % mmap.PAGESIZE == 0 and memory.flags.writeable
    assert resident_pages(memory) == (0, 64)  # (reading would map the kernel's shared zero page: read it last)
    memory[3 * mmap.PAGESIZE + 5] = 7
    assert resident_pages(memory) == (1, 64)
    host_pages.commit_pages(memory)
    assert resident_pages(memory) == (64, 64)
    assert memory[3 * mmap.PAGESIZE + 5] == 7 and int(memory.sum()) == 7  # zero elsewhere; populating wrote nothing


@linux_only
def test_where_the_kernel_refuses_to_populate_each_page_is_written_instead(monkeypatch):
    monkeypatch.setattr(host_pages, "_libc_madvise", lambda: None)
    memory = host_pages.zeroed_host_bytes(16 * mmap.PAGESIZE + 100)  # a partial last page too
    host_pages.commit_pages(memory)
    assert resident_pages(memory) == (17, 17) and not memory.any()


def test_an_empty_buffer_needs_no_pages():
    memory = host_pages.zeroed_host_bytes(0)
    host_pages.commit_pages(memory)
    assert memory.nbytes == 0


@linux_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pool_committed_at_start_is_resident_and_still_zero(dtype):
    kv_cache = KVCache(KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype),
                       num_blocks=40, device=torch.device("cpu"))  # 2 x 2 x 40 x 16 x 2 x 64 elements
    assert resident_pages(pool_bytes(kv_cache))[0] == 0
    assert kv_cache.commit_host_pages() >= 0.0
    resident, pages = resident_pages(pool_bytes(kv_cache))
    assert resident == pages > 0 and not kv_cache.kv.any()


@linux_only
@pytest.mark.parametrize("resident", [False, True])
def test_an_engine_commits_its_pool_at_start_only_when_asked(tmp_path, resident):
    with make_llm(str(make_checkpoint(tmp_path, "llama")), device="cpu", kv_cache_memory=8 << 20,
                  kv_cache_resident=resident) as llm:
        committed, pages = resident_pages(pool_bytes(llm.engine.kv_cache))
        assert committed == (pages if resident else 0)
        assert llm.generate(prompt_token_ids=[[1, 2, 3, 4]], use_tqdm=False)[0].outputs[0].token_ids
        assert_all_blocks_free(llm)


def test_kv_cache_resident_must_be_a_bool():
    with pytest.raises(ValueError, match="kv_cache_resident must be a bool"):
        EngineConfig(kv_cache_resident="yes")


def test_serve_commits_its_pools_unless_told_not_to():
    from cluster.serve_flags import add_engine_arguments, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args([])).kv_cache_resident is True
    assert engine_config_from_args(parser.parse_args(["--no-kv-cache-resident"])).kv_cache_resident is False
