"""Tensor-parallel layers and layout against unsharded torch references, over a real 2-rank gloo group."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.model.loader import iter_checkpoint_tensors
from engine.model.tp_layers import ParallelLMHead, RowParallelLinear, TPShard, VocabParallelEmbedding
from engine.parallel.layout import check_tp_shapes, kv_head_span, tp_layout
from engine.model.tp_weights import safetensors_slices, sliced
from tests.support.tp_ranks import RankGroup

HIDDEN, INTER, VOCAB = 16, 24, 259  # 259 = 2 * 130 - 1: the last rank's vocabulary shard is padded


@pytest.fixture(scope="module")
def ranks():
    """`ranks(size) -> RankGroup`: a real gloo group of `size` spawned ranks, started once for this module (each test
    runs its function on every rank; a group that failed is started anew)."""
    groups: dict[int, RankGroup] = {}

    def get(size: int) -> RankGroup:
        if size not in groups or groups[size].closed:
            groups[size] = RankGroup(size)
        return groups[size]

    yield get
    for group in groups.values():
        group.close()


def small_config(num_heads: int = 4, num_kv_heads: int = 2, intermediate: int = INTER) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", VOCAB, HIDDEN, intermediate, 1, num_heads, num_kv_heads, 4, 64)


def _materialized(module: torch.nn.Module) -> torch.nn.Module:
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype))


def _row_parallel(group, weight, bias, x):
    cfg = small_config()
    layout = tp_layout(cfg, group.rank, group.size)
    layer = _materialized(RowParallelLinear(layout.intermediate_size, HIDDEN, True, torch.float32,
                                            TPShard(layout, group)))
    pieces = dict(sliced([("model.layers.0.mlp.down_proj.weight", weight),
                          ("model.layers.0.self_attn.o_proj.bias", bias)], cfg, layout))
    with torch.no_grad():
        layer.weight.copy_(pieces["model.layers.0.mlp.down_proj.weight"])
        if layer.bias is not None:
            layer.bias.copy_(pieces["model.layers.0.self_attn.o_proj.bias"])
    layer.prepare()
    start, stop = layout.intermediate
    with torch.no_grad():
        return [layer(x[:rows, start:stop]) for rows in (3, 300)], layer.bias is not None  # oneDNN and MKL paths


def test_row_parallel_linear_equals_unsharded_linear(ranks):
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(HIDDEN, INTER, generator=generator), torch.randn(HIDDEN, generator=generator)
    x = torch.randn(300, INTER, generator=generator)
    results = ranks(2).run(_row_parallel, weight, bias, x)
    assert [has_bias for _, has_bias in results] == [True, False]  # the bias is added once, by rank 0
    for outputs, _ in results:
        for out in outputs:
            torch.testing.assert_close(out, F.linear(x[:out.shape[0]], weight, bias), rtol=1e-5, atol=1e-5)


def _vocab_parallel(group, table, ids, hidden):
    cfg = small_config()
    layout = tp_layout(cfg, group.rank, group.size)
    shard = TPShard(layout, group)
    embed = _materialized(VocabParallelEmbedding(HIDDEN, torch.float32, shard))
    head = _materialized(ParallelLMHead(HIDDEN, VOCAB, torch.float32, shard))
    piece = dict(sliced([("model.embed_tokens.weight", table)], cfg, layout))["model.embed_tokens.weight"]
    with torch.no_grad():
        for param in (embed.weight, head.weight):
            param.zero_()
            param[:piece.shape[0]].copy_(piece)
        return layout.vocab, embed(ids), head.gather(head(hidden))


def test_vocab_parallel_embedding_and_lm_head_equal_unsharded(ranks):
    generator = torch.Generator().manual_seed(1)
    table = torch.randn(VOCAB, HIDDEN, generator=generator)
    ids = torch.tensor([0, 129, 130, 258, 7, 200])
    hidden = torch.randn(5, HIDDEN, generator=generator)
    (span0, embedded0, logits0), (span1, embedded1, logits1) = ranks(2).run(_vocab_parallel, table, ids, hidden)
    assert (span0, span1) == ((0, 130), (130, 259))
    for embedded in (embedded0, embedded1):
        torch.testing.assert_close(embedded, F.embedding(ids, table))
    assert logits0.shape == (5, VOCAB) and logits1 is None  # gathered where sampling runs, rank 0 only
    torch.testing.assert_close(logits0, hidden @ table.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,size", [(4, 2, 2), (4, 1, 2), (8, 2, 4), (8, 4, 2), (8, 8, 8), (16, 2, 8)])
def test_every_query_head_reads_a_kv_head_its_rank_holds(heads, kv_heads, size):
    cfg = small_config(heads, kv_heads)
    layouts = [tp_layout(cfg, r, size) for r in range(size)]
    assert [h for lay in layouts for h in range(*lay.q_heads)] == list(range(heads))
    group = heads // kv_heads
    for lay in layouts:
        assert all(lay.kv_heads[0] <= h // group < lay.kv_heads[1] for h in range(*lay.q_heads))
    held = {h for lay in layouts for h in range(*lay.kv_heads)}
    assert held == set(range(kv_heads))
    assert all(lay.num_kv_heads == max(1, kv_heads // size) for lay in layouts)


def test_kv_heads_fewer_than_ranks_are_replicated():
    assert [kv_head_span(1, r, 2) for r in range(2)] == [(0, 1), (0, 1)]
    assert [kv_head_span(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_span(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]


@pytest.mark.parametrize("cfg,size,words", [
    (small_config(4, 2), 3, "4 attention heads"),
    (small_config(12, 6), 4, "does not divide the model's 6 KV heads"),
    (small_config(12, 4), 6, "is not a multiple of the model's 4 KV heads"),
    (small_config(4, 2, intermediate=25), 2, "intermediate_size 25"),
    (small_config(), 0, "must be an int >= 1"),
])
def test_shapes_that_do_not_split_are_value_errors(cfg, size, words):
    with pytest.raises(ValueError, match=words):
        check_tp_shapes(cfg, size)


def test_safetensors_slices_equal_slices_of_the_whole_tensors(tiny_checkpoint):
    path = tiny_checkpoint("qwen2")
    cfg = ModelConfig.from_dir(path)
    whole = list(iter_checkpoint_tensors(path))
    for rank in range(2):
        layout = tp_layout(cfg, rank, 2)
        read = dict(safetensors_slices(path, cfg, layout))
        expected = dict(sliced(whole, cfg, layout))
        assert read.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(read[name], tensor), name
        q = read["model.layers.0.self_attn.q_proj.weight"]
        assert q.shape == (cfg.num_heads // 2 * cfg.head_dim, cfg.hidden_size)


def _shared_memory_sums(group, path, slot_bytes, tensors):
    from pathlib import Path

    from engine.parallel.host_reduce import SharedMemoryReducer
    reducer = SharedMemoryReducer(Path(path), group.rank, group.size, slot_bytes, lambda: True)
    out = []
    for tensor in tensors:  # more ops than the two generations of slots, of changing sizes
        x = tensor * (group.rank + 1) + group.rank
        assert reducer.fits(x)
        out.append(reducer.all_reduce_(x.contiguous()))
    assert not reducer.fits(torch.zeros(slot_bytes // 4 + 1))  # larger: gloo's
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_shared_memory_all_reduce_equals_the_sum_on_every_rank(size, tmp_path, ranks):
    from engine.parallel.host_reduce import create_file
    generator = torch.Generator().manual_seed(5)
    tensors = [torch.randn(rows, HIDDEN, generator=generator) for rows in (8, 1, 300, 8, 5, 64)]
    slot_bytes = 300 * HIDDEN * 4
    create_file(tmp_path / "reduce", size, slot_bytes)
    results = ranks(size).run(_shared_memory_sums, str(tmp_path / "reduce"), slot_bytes, tensors)
    for op, tensor in enumerate(tensors):
        expected = sum(tensor * (r + 1) + r for r in range(size))
        for rank in range(size):
            torch.testing.assert_close(results[rank][op], expected)
            assert torch.equal(results[rank][op], results[0][op])  # the ranks' hidden states stay identical
