"""KV blocks between a tensor-parallel group's ranks and one full-head tensor on rank 0
(engine/runner/group_kv.py), over real gloo groups of spawned ranks: a gather equals the single-rank engine's KV of
the same prompt, a scatter writes each rank exactly its heads (replicated heads on every rank that holds them).
In this process, with the other ranks' parts ready-made, what rank 0 allocates and writes (every aten op, counted
against a torch reference): a gather writes each head once straight into the staging blocks, no merged tensor
between; a scatter reads each rank's heads of the staging blocks once and sends each rank only its own."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.parallel.layout import tp_layout
from engine.parallel.step_message import KV_GATHER
from engine.runner.group_kv import gather_kv_heads, gather_layer_heads, scatter_kv_heads
from tests.support.child_processes import FORKED_RANKS
from tests.support.engine_checks import assert_all_blocks_free, random_prompts

PREFILL = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # 1: the first token ends it, no KV kept


def _prefilled_kv(engine, prompt: list[int], gather) -> torch.Tensor:
    """Prefill `prompt` as a prefill-only request; the KV of its blocks by `gather`, then the blocks freed."""
    engine.add_request("r", prompt, PREFILL, prefill_only=True)
    while not any(delta.kv_block_ids is not None for delta in engine.step()):
        pass
    blocks = engine.take_prefilled_blocks("r")
    try:
        return gather(blocks).clone()
    finally:
        engine.free_blocks(blocks)


@pytest.fixture(scope="module")
def tp_group(tiny_checkpoint):
    """`get(arch, size) -> LLM`: a float32 CPU engine of `size` ranks, started once for this module's tests (each
    test leaves every block free: checked); every group is closed at the end."""
    groups: dict[tuple[str, int], LLM] = {}

    def get(arch: str, size: int) -> LLM:
        if (arch, size) not in groups:
            groups[arch, size] = LLM(str(tiny_checkpoint(arch)), dtype="float32", device="cpu",
                                     tensor_parallel_size=size, **FORKED_RANKS)
        return groups[arch, size]

    yield get
    for group in groups.values():
        group.close()


# llama: 2 KV heads over 2 ranks (one each); qwen3: 1 KV head, replicated on both ranks
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gathered_heads_equal_the_single_rank_engines_kv(arch, tiny_checkpoint, tp_group):
    path = str(tiny_checkpoint(arch))
    prompt = random_prompts([37], 200, seed=3)[0]
    with LLM(path, dtype="float32", device="cpu") as single:
        engine = single.engine
        expected = _prefilled_kv(engine, prompt, lambda ids: engine.kv_cache.kv[:, :, ids])
    group = tp_group(arch, 2)
    engine = group.engine
    engine.kv_cache.allocator.reset_prefix_cache()  # the prompt is prefilled here, not found cached
    got = _prefilled_kv(engine, prompt, engine.tp_leader.gather_kv_heads)
    assert got.shape == expected.shape  # [L, 2, n, bs, num_kv_heads, D]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert_all_blocks_free(group)


@pytest.mark.parametrize("arch,size", [("llama", 2), ("qwen3", 2), ("llama3", 4)])
def test_a_scatter_writes_each_rank_its_heads_and_a_gather_reads_them_back(arch, size, tp_group):
    group = tp_group(arch, size)
    engine, leader = group.engine, group.engine.tp_leader
    blocks = engine.reserve_blocks(3)
    kv = engine.kv_cache.kv
    full = torch.randn(kv.shape[0], 2, 3, kv.shape[3], engine.model_config.num_kv_heads, kv.shape[5])
    leader.scatter_kv_heads(blocks, full)
    lo, hi = engine.kv_cache.head_range
    assert torch.equal(kv[:, :, blocks], full[..., lo:hi, :])  # rank 0's own heads
    assert torch.equal(leader.gather_kv_heads(blocks), full)   # every rank's, back on rank 0
    engine.free_blocks(blocks)
    prompts = random_prompts([5, 20], engine.model_config.vocab_size, seed=2)
    assert [len(o.outputs[0].token_ids) for o in group.generate(prompt_token_ids=prompts,
            sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))] == [4, 4]  # the group still steps
    assert_all_blocks_free(group)


# ---- rank 0's bytes, in this process: the other ranks' parts are ready-made (their reads are not rank 0's work)

L, BS, D, ENGINE_BLOCKS, STAGING_BLOCKS = 2, 4, 8, 8, 10


class _Rank0Group:
    """Rank 0's side of the collectives: gather returns rank 0's x and the others' ready parts; scatter keeps the
    parts it was given (`sent`) and writes rank 0's into out."""

    def __init__(self, others: list[torch.Tensor]) -> None:
        self.others, self.size, self.sent = others, len(others) + 1, []

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x.contiguous()] + self.others

    def scatter(self, parts: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        self.sent.append(parts)
        return out.copy_(parts[0])


class _Channel:
    def __init__(self, group: _Rank0Group) -> None:
        self.group, self.moves = group, []

    def send_kv_move(self, move) -> None:
        self.moves.append(move)


class _CopyLog(TorchDispatchMode):
    """Every aten op rank 0 runs: the sizes of the tensors it allocates (views aside) and of what in-place ops write
    into `target`'s storage (the source's numel: copy_ and index_copy_ write exactly that many elements)."""

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self.target, self.allocated, self.written = target.untyped_storage().data_ptr(), [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        first = func._schema.arguments[0] if func._schema.arguments else None
        if first is not None and first.alias_info is not None and first.alias_info.is_write:
            source = [a for a in args[1:] if isinstance(a, torch.Tensor)][-1]  # copy_(dst, src); index_copy_(.., src)
            if args[0].untyped_storage().data_ptr() == self.target:
                self.written.append(source.numel())
        elif not func.is_view and isinstance(result, torch.Tensor):
            self.allocated.append(tuple(result.shape))
        return result


def _model(num_kv_heads: int) -> ModelConfig:
    return ModelConfig("llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=L, num_heads=8,
                       num_kv_heads=num_kv_heads, head_dim=D, max_position_embeddings=64)


def _ranks(model: ModelConfig, size: int, block_ids: list[int]):
    """The model's KV ([L, 2, ENGINE_BLOCKS, BS, H, D], random), rank 0's pool (its heads of it), and rank 0's
    channel whose group holds the other ranks' parts of block_ids."""
    reference = torch.randn(L, 2, ENGINE_BLOCKS, BS, model.num_kv_heads, D)
    pools = []
    for rank in range(size):
        lo, hi = tp_layout(model, rank, size).kv_heads
        pools.append(SimpleNamespace(kv=reference[..., lo:hi, :].clone(), head_range=(lo, hi)))
    others = [pool.kv[:, :, block_ids].contiguous() for pool in pools[1:]]  # [L, 2, n, BS, h, D] each
    return reference, pools[0], _Channel(_Rank0Group(others))


# (H, size): H split over the ranks; 2 heads on 4 ranks and 1 on 2 (replicated: each head written once)
@pytest.mark.parametrize("heads,size", [(4, 2), (2, 4), (1, 2)])
@pytest.mark.parametrize("staged", [[3, 4, 5], [6, 1, 4]])  # consecutive: slices; else index_copy_
def test_a_gather_writes_each_head_once_straight_into_the_staging_blocks(heads, size, staged):
    model, block_ids = _model(heads), [5, 2, 7]
    reference, pool, channel = _ranks(model, size, block_ids)
    staging = torch.randn(L, 2, STAGING_BLOCKS, BS, heads, D)  # [L, 2, N, BS, H, D]
    expected = staging.clone()
    expected[:, :, staged] = reference[:, :, block_ids]
    with _CopyLog(staging) as log:
        assert gather_kv_heads(channel, pool, model, block_ids, out=staging, out_blocks=staged) is staging
    assert torch.equal(staging, expected)  # bit-exact; the other staging blocks unchanged
    own = (L, 2, len(block_ids), BS, pool.kv.shape[-2], D)
    assert [shape for shape in log.allocated if len(shape) > 1] == [own]  # rank 0's read of its heads, nothing else
    assert sum(log.written) == reference[:, :, block_ids].numel()  # every head written once...
    assert len(log.written) == min(heads, size)  # ...one copy per distinct holder
    assert [(m.kind, m.block_ids) for m in channel.moves] == [(KV_GATHER, block_ids)]


def test_the_copy_log_sees_the_merged_tensor_a_gather_without_out_builds():
    model, block_ids, staged = _model(4), [5, 2, 7], [3, 4, 5]
    reference, pool, channel = _ranks(model, 2, block_ids)
    staging = torch.zeros(L, 2, STAGING_BLOCKS, BS, 4, D)
    with _CopyLog(staging) as log:
        staging[:, :, staged] = gather_kv_heads(channel, pool, model, block_ids)  # the path before: merge, assign
    assert (L, 2, 3, BS, 4, D) in log.allocated and sum(log.written) == reference[:, :, block_ids].numel()
    assert torch.equal(staging[:, :, staged], reference[:, :, block_ids])


@pytest.mark.parametrize("heads,size", [(4, 2), (1, 2)])
def test_a_layer_gather_writes_straight_into_the_staging_layer(heads, size):
    model, block_ids, staged = _model(heads), [5, 2, 7], torch.tensor([6, 1, 4])
    reference, pool, _ = _ranks(model, size, block_ids)
    ids = torch.tensor(block_ids)
    for layer in range(L):
        others = [_ranks_layer_part(reference, model, rank, size, layer, ids) for rank in range(1, size)]
        staging = torch.randn(2, STAGING_BLOCKS, BS, heads, D)  # one layer of the pool
        expected = staging.clone()
        expected[:, staged] = reference[layer][:, block_ids]
        with _CopyLog(staging) as log:
            gather_layer_heads(_Rank0Group(others), pool, model, layer, ids, out=staging, out_blocks=staged)
        assert torch.equal(staging, expected)
        assert [shape for shape in log.allocated if len(shape) > 1] == [(2, 3, BS, pool.kv.shape[-2], D)]
        assert torch.equal(gather_layer_heads(_Rank0Group(others), pool, model, layer, ids),
                           reference[layer][:, block_ids])  # without out: a new tensor, as before


def _ranks_layer_part(reference, model, rank: int, size: int, layer: int, ids: torch.Tensor) -> torch.Tensor:
    lo, hi = tp_layout(model, rank, size).kv_heads
    return reference[layer][..., lo:hi, :].index_select(1, ids)  # [2, n, BS, h, D]


@pytest.mark.parametrize("heads, size", [(4, 2), (2, 4), (1, 2)])
@pytest.mark.parametrize("staged", [[3, 4, 5], [6, 1, 4]])
def test_a_scatter_sends_each_rank_only_its_heads_read_once_from_the_staging_blocks(heads, size, staged):
    model, block_ids = _model(heads), [5, 2, 7]
    _, pool, channel = _ranks(model, size, block_ids)
    staging = torch.randn(L, 2, STAGING_BLOCKS, BS, heads, D)
    before, kept = staging.clone(), pool.kv.clone()
    with _CopyLog(pool.kv) as log:
        scatter_kv_heads(channel, pool, model, block_ids, staging, full_blocks=staged)
    full = before[:, :, staged]  # [L, 2, n, BS, H, D]
    parts = channel.group.sent[0]
    for rank, part in enumerate(parts):  # each rank gets its heads and no others: 1/size of a broadcast's bytes
        lo, hi = tp_layout(model, rank, size).kv_heads
        assert torch.equal(part, full[..., lo:hi, :])
    big = [shape for shape in log.allocated if len(shape) > 1]
    assert big == [parts[0].shape] * (size + 1)  # each rank's part, and rank 0's receive buffer: no full tensor
    assert torch.equal(staging, before)
    lo, hi = pool.head_range
    kept[:, :, block_ids] = full[..., lo:hi, :]
    assert torch.equal(pool.kv, kept) and sum(log.written) == kept[:, :, block_ids].numel()  # its heads, once
