"""An engine's lifecycle: close() aborts what runs, frees every block, lets go of the model and the KV pool
(nothing references them afterwards, so their memory is freed), and a closed engine answers EngineClosed."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from engine import LLM, EngineClosed, SamplingParams
from tests.support.engine_checks import random_prompts

LONG = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def _held_tensors(llm: LLM) -> list[weakref.ref]:
    """Weak references to the KV pool and every model weight."""
    runner = llm.engine.runner
    return [weakref.ref(llm.engine.kv_cache.kv), *(weakref.ref(p) for p in runner.model.parameters())]


def test_close_frees_the_pool_and_the_model(ckpt):
    llm = LLM(ckpt, kv_cache_memory=4 << 20)
    assert llm.generate(prompt_token_ids=random_prompts([9], 300), sampling_params=LONG, use_tqdm=False)
    held = _held_tensors(llm)
    llm.close()
    gc.collect()
    alive = [ref for ref in held if ref() is not None]
    assert not alive, f"{len(alive)} of {len(held)} tensors (pool, weights) still referenced after close()"
    assert llm.engine.closed


def test_close_twice_and_use_after_close(ckpt):
    llm = LLM(ckpt, kv_cache_memory=4 << 20)
    llm.close()
    llm.close()
    engine = llm.engine
    with pytest.raises(EngineClosed, match="closed"):
        llm.generate(prompt_token_ids=random_prompts([5], 300), sampling_params=LONG, use_tqdm=False)
    for call in (engine.step, lambda: engine.reserve_blocks(1), lambda: engine.pin_cached_prefix([1, 2, 3]),
                 lambda: engine.take_prefilled_blocks("x"), lambda: engine.num_free_blocks,
                 lambda: engine.add_prefilled_request("x", [1, 2], 3, SamplingParams(), [0])):
        with pytest.raises(EngineClosed):
            call()
    assert engine.abort("x") is False and engine.release_prefilled("x") is False
    engine.free_blocks([0, 1])  # a transfer ending late finds nothing to free: no error
    assert not engine.has_unfinished_requests() and engine.num_live_requests == 0


def test_close_while_requests_run_aborts_them_and_frees_their_blocks(ckpt):
    llm = LLM(ckpt, kv_cache_memory=4 << 20, enable_prefix_caching=False)
    engine = llm.engine
    allocator, total = engine.kv_cache.allocator, engine.num_total_blocks
    for index, prompt in enumerate(random_prompts([40, 7, 23], 300, seed=3)):
        engine.add_request(f"full-{index}", prompt, LONG)
    engine.add_request("prefill-only", random_prompts([30], 300, seed=4)[0], LONG, prefill_only=True)
    reserved = engine.reserve_blocks(2)  # a transfer's blocks: the caller owns them, close() does not
    for _ in range(3):
        engine.step()
    assert engine.num_live_requests == 4 and allocator.num_free_blocks < total - len(reserved)
    llm.close()
    assert engine.num_live_requests == 0 and not engine.has_unfinished_requests()
    assert allocator.num_free_blocks == total - len(reserved), "close() must free every live request's blocks"


def test_with_block_closes_the_engine_even_when_it_raises(ckpt):
    with pytest.raises(ZeroDivisionError):
        with LLM(ckpt, kv_cache_memory=4 << 20) as llm:
            held = _held_tensors(llm)
            1 / 0
    gc.collect()
    assert llm.engine.closed and all(ref() is None for ref in held)
    with LLM(ckpt, kv_cache_memory=4 << 20) as second:  # the next engine in the process starts as usual
        out = second.generate(prompt_token_ids=random_prompts([6], 300), sampling_params=LONG, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_card_gets_its_memory_back(ckpt):
    """An engine that takes half the card (its KV pool, CUDA graphs and their pools, cuBLAS workspaces) gives it all
    back: what this process holds of the card returns to within 1 GiB of where it was. Counted as the memory torch
    holds from the driver (everything above lives in it), not the card's free memory: under pytest -n 4 the other
    workers' engines come and go on the same card."""
    torch.cuda.init()
    torch.cuda.synchronize()
    held_before = torch.cuda.memory_reserved()
    llm = LLM(ckpt, gpu_memory_utilization=0.5)
    llm.generate(prompt_token_ids=random_prompts([9, 40], 300), sampling_params=LONG, use_tqdm=False)
    taken = torch.cuda.memory_reserved() - held_before
    assert taken > 4 << 30, f"the engine took only {taken / 2**30:.1f} GiB"
    llm.close()
    still_taken = torch.cuda.memory_reserved() - held_before
    assert still_taken < 1 << 30, f"{still_taken / 2**30:.2f} GiB not given back after close()"
