"""Piecewise graphs of prefill and mixed steps, without capturing (capture=False): the forward's pieces, their
static buffers and the padding to the token ladder run eager, over the numba backend (unfused layers: the K/V
store in the eager attention) and over the Triton kernels (fused: the store inside the piece; under the interpreter
without a GPU). Every token equals transformers'. The capture itself needs CUDA (the last test)."""
from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.attention.backends import TorchBackend, triton_available
from engine.runner.mixed_graphs import MixedGraphs, mixed_graphs_for, token_buckets
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import TEST_DEVICE, make_llm
from tests.support.launch_count import LaunchCounter

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
PROMPT_LENGTHS = [5, 40, 23, 61]  # chunked by a 32-token step: prompt chunks beside decodes, chunks after others
MAX_TOKENS = [6, 3, 5, 4]


def test_the_ladder_pads_a_step_by_at_most_a_quarter():
    sizes = token_buckets(2048)
    assert sizes[:4] == (16, 32, 48, 64) and sizes[-1] == 2048 and list(sizes) == sorted(set(sizes))
    for tokens in range(1, 2049):
        assert next(s for s in sizes if s >= tokens) - tokens <= tokens // 4 + 15
    assert token_buckets(10) == (10,)
    with pytest.raises(ValueError, match="max_tokens"):
        token_buckets(0)


def _generate_through_pieces(llm, path, hf_greedy, max_tokens: int) -> list[tuple[int, int, int]]:
    """Generates PROMPT_LENGTHS' prompts with every prefill and mixed step through MixedGraphs(capture=False);
    asserts every token equals transformers' and no block is left; returns (tokens, decode rows, sequences) of
    each step the pieces ran."""
    engine = llm.engine
    graphs = MixedGraphs(engine.runner.model, engine.kv_cache, engine.runner.attention, max_tokens,
                         engine.device, capture=False)
    steps = []
    forward = graphs.forward
    graphs.forward = lambda ids, pos, meta, *rest: steps.append(
        (ids.shape[0], meta.num_decode_rows, meta.num_seqs)) or forward(ids, pos, meta, *rest)
    engine.runner.mixed_graphs = graphs
    _generate_equals_transformers(llm, path, hf_greedy, seed=11)
    return steps


def _generate_equals_transformers(llm, path, hf_greedy, seed: int) -> None:
    """PROMPT_LENGTHS' prompts, MAX_TOKENS each: every token transformers', no block left."""
    prompts = random_prompts(PROMPT_LENGTHS, llm.get_tokenizer().vocab_size, seed=seed)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    expected = hf_greedy(path, prompts, max(MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in outputs] == [e[:n] for e, n in zip(expected, MAX_TOKENS)]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: per-head q/k norms make new q, k tensors
def test_unfused_pieces_match_transformers(tiny_checkpoint, hf_greedy, arch):
    path = tiny_checkpoint(arch)
    with make_llm(str(path), dtype="float32", device="cpu", attention_backend="cpu_kernel", max_num_seqs=8,
                  max_num_batched_tokens=32, max_model_len=96) as llm:
        steps = _generate_through_pieces(llm, path, hf_greedy, max_tokens=32)
    assert any(decodes and seqs > decodes for _, decodes, seqs in steps), steps  # mixed steps ran
    assert any(tokens not in token_buckets(32) for tokens, _, _ in steps), steps  # and padded ones


@needs_triton
def test_fused_pieces_match_transformers(tiny_checkpoint, hf_greedy):
    path = tiny_checkpoint("qwen2")
    with make_llm(str(path), dtype="float32", device=TEST_DEVICE.type, attention_backend="triton", max_num_seqs=8,
                  max_num_batched_tokens=32, max_model_len=96) as llm:
        steps = _generate_through_pieces(llm, path, hf_greedy, max_tokens=24)  # steps of 25-32 tokens run eager
    assert any(decodes and seqs > decodes for _, decodes, seqs in steps), steps


def _mixed_step_launches(llm, graphs: MixedGraphs | None) -> LaunchCounter:
    """The launches a GPU would take from the host for one mixed step (a decode beside a 20-token prompt), every
    piece replay counted as one launch (what run_piece issues is inside its graph)."""
    from engine.attention import triton_decode, triton_prefill, triton_store
    from engine.model import fused_triton
    engine, counter = llm.engine, LaunchCounter()
    if graphs is not None:
        run_piece = graphs.pieces.run_piece

        def replay(index: int, n: int) -> None:
            counter.triton["piece replay"] += counter.counting
            counter.counting, on = False, counter.counting
            try:
                run_piece(index, n)
            finally:
                counter.counting = on
        graphs.pieces.run_piece = replay
        engine.runner.mixed_graphs = graphs
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("decoding", [5, 6, 7, 8, 9], params)
    engine.step()
    engine.add_request("prompt", list(range(10, 30)), params)
    with counter, counter.triton_launches(fused_triton, triton_decode, triton_store, triton_prefill):
        counter.counting = True
        engine.step()
    for request_id in ("decoding", "prompt"):
        engine.abort(request_id)
    return counter


@needs_triton
def test_a_mixed_step_launches_a_replay_per_piece_and_its_attention(tiny_checkpoint):
    """The CPU proxy of what the graphs save: per layer, the eager mixed step launches its norms, projections,
    rotation and store, SiLU x up and attention; the piecewise one a replay and the attention only."""
    # on a GPU too (no graph of its own: mixed_graph_max_tokens=0; the pieces below run uncaptured)
    path = str(tiny_checkpoint("llama"))
    options = dict(dtype="float32", device=TEST_DEVICE.type, attention_backend="triton", mixed_graph_max_tokens=0)
    with make_llm(path, **options) as eager, make_llm(path, **options) as pieced:
        num_layers = len(eager.engine.runner.model.layers)
        graphs = MixedGraphs(pieced.engine.runner.model, pieced.engine.kv_cache, pieced.engine.runner.attention,
                             64, pieced.engine.device, capture=False)
        before, after = _mixed_step_launches(eager, None), _mixed_step_launches(pieced, graphs)
        assert after.triton["piece replay"] == num_layers + 1
        attention = sum(n for name, n in after.triton.items() if name != "piece replay")
        assert attention == num_layers, dict(after.triton)  # the prefill kernel, the short decode row in it
        assert after.total < before.total - 4 * num_layers, (before.total, after.total)
        assert_all_blocks_free(eager)
        assert_all_blocks_free(pieced)


def test_mixed_graphs_only_where_they_apply(tiny_checkpoint):
    with make_llm(str(tiny_checkpoint("llama")), device="cpu") as llm:
        engine = llm.engine
        assert engine.runner.mixed_graphs is None  # CPU: nothing is captured
        args = (engine.runner.model, engine.kv_cache)
        cuda = torch.device("cuda")
        assert mixed_graphs_for(*args, TorchBackend(), EngineConfig(), cuda) is None  # not the triton backend
        triton = type("Triton", (), {"supports_decode_graphs": True, "fused_layers": True})()
        assert mixed_graphs_for(*args, triton, EngineConfig(enforce_eager=True), cuda) is None
        assert mixed_graphs_for(*args, triton, EngineConfig(mixed_graph_max_tokens=0), cuda) is None
        assert mixed_graphs_for(*args, triton, EngineConfig(), torch.device("cpu")) is None
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="mixed_graph_max_tokens"):
            EngineConfig(mixed_graph_max_tokens=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture needs CUDA")
def test_captured_pieces_match_transformers_on_cuda(tiny_checkpoint, hf_greedy):
    path = tiny_checkpoint("llama3")
    with make_llm(str(path), dtype="float32", device="cuda", max_num_seqs=8, max_num_batched_tokens=32,
                  max_model_len=96) as llm:
        graphs = llm.engine.runner.mixed_graphs
        assert graphs is not None and graphs.captured_sizes == token_buckets(32), "mixed graphs were not captured"
        _generate_equals_transformers(llm, path, hf_greedy, seed=12)
