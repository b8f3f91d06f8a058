"""Decode graphs without capturing: the static buffers, padding to the ladder and replay path run eagerly
(capture=False), with the Triton kernels on the GPU or, without one, under the interpreter; the capture itself
needs CUDA (the last test)."""
from __future__ import annotations

import gc

import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.attention.backends import TorchBackend, triton_available
from engine.runner.decode_graphs import DecodeGraphs, batch_size_ladder, decode_graphs_for
from engine.runner.device_memory import garbage_collection_paused
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import TEST_DEVICE, kernel_tensor, make_llm

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def test_ladder_doubles_up_to_max_num_seqs():
    assert batch_size_ladder(1) == (1,)
    assert batch_size_ladder(6) == (1, 2, 4, 6)
    assert batch_size_ladder(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)


@needs_triton
def test_padded_static_decode_matches_transformers(tiny_checkpoint, hf_greedy):
    """Five requests of different lengths finish at different steps (one step apart), so decode batches of 5, 4, 3,
    2, 1 rows replay the 8-, 4- and 2-row graphs with padding rows; every token equals transformers'."""
    path = tiny_checkpoint("qwen2")
    llm = make_llm(str(path), dtype="float32", device=TEST_DEVICE.type, attention_backend="triton", max_num_seqs=8,
                   max_num_batched_tokens=96, max_model_len=64)  # every prompt in one step, none default-sized
    engine = llm.engine
    graphs = DecodeGraphs(engine.runner.model, engine.kv_cache, engine.runner.attention, max_num_seqs=8,
                          max_model_len=engine.max_model_len, device=TEST_DEVICE, capture=False)
    replayed = []
    run = graphs.run_staged
    graphs.run_staged = lambda batch, *rest: replayed.append(len(batch.input_ids)) or run(batch, *rest)
    engine.runner.decode_graphs = graphs
    prompts = random_prompts([3, 12, 21, 7, 30], llm.get_tokenizer().vocab_size, seed=5)
    max_tokens = [2, 3, 4, 5, 6]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    expected = hf_greedy(path, prompts, max(max_tokens))
    assert [o.outputs[0].token_ids for o in outputs] == [e[:n] for e, n in zip(expected, max_tokens)]
    assert set(replayed) >= {5, 3, 1}, replayed
    assert_all_blocks_free(llm)


@needs_triton
def test_padding_rows_write_nothing_into_the_pool():
    from engine.attention.triton_store import store_kv
    k_pool, v_pool = kernel_tensor(torch.zeros(64, 2, 16)), kernel_tensor(torch.zeros(64, 2, 16))
    k, v = kernel_tensor(torch.randn(5, 2, 16)), kernel_tensor(torch.randn(5, 2, 16))
    slots = kernel_tensor(torch.tensor([7, 3, -1, 40, -1]))
    store_kv(k, v, k_pool, v_pool, slots)
    assert torch.equal(k_pool[[7, 3, 40]], k[[0, 1, 3]]) and torch.equal(v_pool[[7, 3, 40]], v[[0, 1, 3]])
    untouched = kernel_tensor(torch.ones(64, dtype=torch.bool))
    untouched[[7, 3, 40]] = False
    assert k_pool[untouched].abs().sum() == 0 and v_pool[untouched].abs().sum() == 0


def test_graphs_only_where_they_apply(tiny_checkpoint):
    llm = make_llm(str(tiny_checkpoint("llama")), device="cpu")
    engine = llm.engine
    assert engine.runner.decode_graphs is None  # CPU: nothing is captured
    args = (engine.runner.model, engine.kv_cache)
    cuda = torch.device("cuda")
    assert decode_graphs_for(*args, TorchBackend(), EngineConfig(), 64, cuda) is None
    assert decode_graphs_for(*args, TorchBackend(), EngineConfig(enforce_eager=True), 64, cuda) is None
    with pytest.raises(ValueError, match="triton"):
        DecodeGraphs(*args, TorchBackend(), 4, 64, torch.device("cpu"), capture=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture needs CUDA")
def test_captured_graphs_match_transformers_on_cuda(tiny_checkpoint, hf_greedy):
    path = tiny_checkpoint("llama3")
    llm = make_llm(str(path), dtype="float32", device="cuda", max_num_seqs=8)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs._graphs, "decode graphs were not captured"
    prompts = random_prompts([3, 20, 33, 7, 50], llm.get_tokenizer().vocab_size, seed=6)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 8)
    eager = make_llm(str(path), dtype="float32", device="cuda", max_num_seqs=8, enforce_eager=True)
    assert eager.engine.runner.decode_graphs is None
    assert_all_blocks_free(llm)


@needs_triton
def test_capture_runs_on_harmless_inputs_whatever_the_buffers_held(tiny_checkpoint):
    """Before its warm-up and capture, a graph's static inputs are set to a harmless step: on CUDA the buffers
    hold a freed tensor's bytes, and an id or position past the embedding or the rotary table failed the gather on
    the device (the Llama-3-8B shape on an H100, session 22). Garbage in, then the capture's inputs: the forward
    runs and writes nothing into the pool."""
    llm = make_llm(str(tiny_checkpoint("llama")), dtype="float32", device=TEST_DEVICE.type,
                   attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    engine = llm.engine
    graphs = DecodeGraphs(engine.runner.model, engine.kv_cache, engine.runner.attention, max_num_seqs=4,
                          max_model_len=engine.max_model_len, device=TEST_DEVICE, capture=False)
    for tensor in graphs._static(4).values():
        tensor.fill_(1 << 30)
    graphs.block_tables.fill_(1 << 30)
    static = graphs._capture_inputs(4)
    assert static["input_ids"].eq(0).all() and static["positions"].eq(0).all()
    assert static["slots"].eq(-1).all() and static["seq_lens"].eq(1).all() and graphs.block_tables.eq(0).all()
    pool = engine.kv_cache.kv.clone()
    hidden = graphs._forward(4)
    assert hidden.shape[0] == 4 and torch.isfinite(hidden).all()
    assert torch.equal(engine.kv_cache.kv, pool)
    assert_all_blocks_free(llm)


class _CyclicGarbage:
    """An object in a reference cycle whose finalizer notes whether a CUDA stream was capturing when it ran."""

    def __init__(self, seen: list[bool]) -> None:
        self.seen, self.cycle = seen, self

    def __del__(self) -> None:
        self.seen.append(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def test_garbage_collection_is_paused_after_one_collection_and_restored():
    seen: list[bool] = []
    _CyclicGarbage(seen)
    assert gc.isenabled()
    with garbage_collection_paused():
        assert seen == [False], "the garbage made before the block is collected on the way in"
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with garbage_collection_paused():
            pass
        assert not gc.isenabled(), "a collector that was off stays off"
    finally:
        gc.enable()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture needs CUDA")
def test_no_garbage_is_collected_while_graphs_are_captured(tiny_checkpoint, monkeypatch):
    """Cyclic garbage made inside every capture (as a finalizer-bearing cycle left by an earlier engine would be
    found there) with the collector set to run at every allocation: none of its finalizers runs while the stream
    captures, where one that frees device memory aborts the process; all run once the capture is over."""
    seen: list[bool] = []
    begin = torch.cuda.CUDAGraph.capture_begin

    def capture_begin_making_garbage(graph, *args, **kwargs):
        begin(graph, *args, **kwargs)
        for _ in range(5):
            _CyclicGarbage(seen)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", capture_begin_making_garbage)
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        llm = make_llm(str(tiny_checkpoint("llama")), dtype="float32", device="cuda", max_num_seqs=8)
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()
    assert seen and not any(seen), f"{sum(seen)} of {len(seen)} finalizers ran inside a capture"
    llm.engine.close()
