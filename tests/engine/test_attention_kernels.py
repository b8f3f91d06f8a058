"""The Triton paged-attention kernels against a plain torch reference.

Without a GPU they run on CPU tensors under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before any kernel module is imported); on a GPU machine the same tests compile and run them on CUDA.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from engine.attention import triton_decode  # noqa: E402
from engine.attention.metadata import query_starts  # noqa: E402
from engine.attention.triton_decode import merge_partitions_reference, paged_decode  # noqa: E402
from engine.attention.triton_prefill import paged_prefill, prune_tiles, tile_configs  # noqa: E402
from tests.support.engines import TEST_DEVICE as DEVICE  # noqa: E402

HEAD_SHAPES = [(4, 4), (8, 2), (8, 1), (14, 2)]  # (query heads, KV heads): GQA 1, 4, 8 and 7 (Qwen2.5-0.5B)
# (heads, kv_heads, head_dim, block_size): every head shape with both head sizes and both block sizes, and every
# head size with every block size (pairwise: the interpreter runs each case for about a second)
KERNEL_SHAPES = [(h, kv, d, bs) for i, (h, kv) in enumerate(HEAD_SHAPES)
                 for d, bs in (((64, 16), (128, 32)) if i % 2 == 0 else ((64, 32), (128, 16)))]


def reference(q, k_pool, v_pool, table, seq_len, block_size):
    """q: [n, H, D], the last n positions of a seq_len context; fp32 SDPA over the gathered context."""
    pos = torch.arange(seq_len, device=q.device)
    slots = table[pos // block_size].long() * block_size + pos % block_size
    k, v = k_pool[slots].transpose(0, 1).float(), v_pool[slots].transpose(0, 1).float()  # [H_kv, L, D]
    query_pos = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)
    mask = pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # [n, L]
    out = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k, v, attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1)  # [n, H, D]


def make_pool(kv_heads, head_dim, block_size, num_blocks=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks * block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(DEVICE), torch.randn(shape, generator=gen).to(DEVICE)


def random_tables(num_seqs, num_blocks, width, seed=1):
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_blocks, generator=gen)[:width] for _ in range(num_seqs)]
    return torch.stack(rows).to(torch.int32).to(DEVICE)  # [N, width]: scattered, not in order


def as_int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", KERNEL_SHAPES)
def test_decode_matches_reference(heads, kv_heads, head_dim, block_size):
    k_pool, v_pool = make_pool(kv_heads, head_dim, block_size)
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3]  # most end mid-block
    tables = random_tables(len(seq_lens), 48, 6)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = paged_decode(q, k_pool, v_pool, tables, as_int32(seq_lens), block_size, max(seq_lens))
    want = torch.cat([reference(q[i:i + 1], k_pool, v_pool, tables[i], n, block_size) for i, n in enumerate(seq_lens)])
    torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_partitions", [2, 5, 9])
def test_decode_split_into_partitions_matches_reference(num_partitions):
    """Flash-decoding: a long context cut into partitions merges to the same result; a short sequence in the
    same batch uses fewer (3 tokens: one), and its grid's other programs store nothing."""
    block_size, heads, kv_heads, head_dim = 16, 8, 2, 64
    k_pool, v_pool = make_pool(kv_heads, head_dim, block_size, num_blocks=64)
    seq_lens = [3, 200, 17 * 16 + 5]
    tables = random_tables(len(seq_lens), 64, 18)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got = paged_decode(q, k_pool, v_pool, tables, as_int32(seq_lens), block_size, max(seq_lens),
                       num_partitions=num_partitions)
    want = torch.cat([reference(q[i:i + 1], k_pool, v_pool, tables[i], n, block_size) for i, n in enumerate(seq_lens)])
    torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-4)


def test_decode_with_more_partitions_than_one_merge_read_matches_reference():
    """1,200 tokens cut into 38 partitions of one 32-key tile, more than the merge kernel reads at once (it
    loops)."""
    block_size, heads, kv_heads, head_dim = 16, 8, 2, 64
    k_pool, v_pool = make_pool(kv_heads, head_dim, block_size, num_blocks=80)
    seq_lens = [1200, 31, 600]
    tables = random_tables(len(seq_lens), 80, 75)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    got = paged_decode(q, k_pool, v_pool, tables, as_int32(seq_lens), block_size, max(seq_lens), num_partitions=38)
    assert -(-1200 // triton_decode.tokens_per_partition(1200, 38, 32)) == 38 > triton_decode.MERGE_BLOCK_P
    want = torch.cat([reference(q[i:i + 1], k_pool, v_pool, tables[i], n, block_size) for i, n in enumerate(seq_lens)])
    torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-4)


def test_partitions_fill_the_device_only_where_the_batch_does_not(monkeypatch):
    """Two programs per streaming multiprocessor (an H200's 132 here): batch x KV heads below that splits each
    context, never into more partitions than it has key tiles; at or above it, no split. Each sequence then cuts
    its own context into whole tiles: a 128-token one in a grid of 132 partitions uses 4, a 32k one 128."""
    monkeypatch.setattr(triton_decode, "_multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    assert triton_decode.choose_num_partitions(2, cuda) == 132  # batch 1, 2 KV heads
    assert triton_decode.choose_num_partitions(64, cuda) == 5  # batch 32
    assert triton_decode.choose_num_partitions(264, cuda) == triton_decode.choose_num_partitions(2000, cuda) == 1
    assert triton_decode.choose_num_partitions(2, torch.device("cpu")) == 1
    scratch = triton_decode.decode_scratch(1, 14, 2, 64, 128, torch.device("cpu"), num_partitions=132)
    assert scratch.num_partitions == 4 and scratch.acc.shape == (1, 14, 4, 64)  # capped at the context's 4 tiles
    assert [triton_decode.tokens_per_partition(n, 132, 32) for n in (1, 128, 4224, 32768)] == [32, 32, 32, 256]


@pytest.mark.parametrize("num_partitions", [1, 5, 32, 45])
def test_merge_kernel_matches_its_reference(num_partitions):
    """Partials of 3 sequences x 4 heads, each context cut into tokens_per_partition(seq_len, P, 16)-token
    partitions: the first uses about half the grid's P, the second all P, the third two; what lies past them
    is -inf / NaN: the merge reads only the partitions a context was cut into."""
    tile = 16
    gen = torch.Generator().manual_seed(num_partitions)
    acc = torch.randn(3, 4, num_partitions, 64, generator=gen)  # [B, H, P, D]
    maxes = torch.randn(3, 4, num_partitions, generator=gen) * 4
    sums = torch.rand(3, 4, num_partitions, generator=gen) + 0.5
    seq_lens = [(num_partitions // 2) * tile + 3, num_partitions * tile, tile + 1]
    used = [-(-n // triton_decode.tokens_per_partition(n, num_partitions, tile)) for n in seq_lens]
    assert used == [num_partitions // 2 + 1, num_partitions, min(2, num_partitions)], used
    maxes[0, :, used[0]:], sums[0, :, used[0]:], acc[0, :, used[0]:] = float("-inf"), 0.0, 0.0
    maxes[2, :, used[2]:], sums[2, :, used[2]:], acc[2, :, used[2]:] = float("nan"), float("nan"), float("nan")
    want = torch.cat([merge_partitions_reference(acc[i:i + 1, :, :n], maxes[i:i + 1, :, :n], sums[i:i + 1, :, :n])
                      for i, n in enumerate(used)])  # [3, 4, 64]
    acc, maxes, sums = acc.to(DEVICE), maxes.to(DEVICE), sums.to(DEVICE)
    out = torch.empty(3, 4, 64, device=DEVICE)
    triton_decode._merge_kernel[(3, 4)](out, acc, maxes, sums, as_int32(seq_lens), out.stride(0), out.stride(1),
                                        num_partitions, HEAD_DIM=64, BLOCK_D=64, BLOCK_N=tile,
                                        BLOCK_P=triton_decode.MERGE_BLOCK_P)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)


def check_prefill(specs, heads, kv_heads, head_dim, block_size, first_seq, table_width, seed):
    """paged_prefill over sequences of (num_computed, num_new) specs, sequences [first_seq, N): each of their rows
    against the reference; the rows before first_seq left untouched (zero)."""
    k_pool, v_pool = make_pool(kv_heads, head_dim, block_size)
    query_start = query_starts([n for _, n in specs])
    seq_lens = [c + n for c, n in specs]
    tables = random_tables(len(specs), 48, table_width)
    q = torch.randn(query_start[-1], heads, head_dim, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    out = torch.zeros_like(q)  # [T, H, D]
    paged_prefill(out, q, k_pool, v_pool, tables, as_int32(query_start), as_int32(seq_lens), first_seq=first_seq,
                  num_seqs=len(specs) - first_seq, max_query_len=max(n for _, n in specs[first_seq:]),
                  block_size=block_size)
    assert out[:query_start[first_seq]].abs().sum() == 0
    for i in range(first_seq, len(specs)):
        start, end = query_start[i], query_start[i + 1]
        want = reference(q[start:end], k_pool, v_pool, tables[i], seq_lens[i], block_size)
        torch.testing.assert_close(out[start:end].float(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", KERNEL_SHAPES)
def test_prefill_over_cached_prefix_matches_reference(heads, kv_heads, head_dim, block_size):
    """Several packed chunks after decode rows: fresh prompts, prefixes cached to a block boundary and to
    mid-block (chunked prefill), new parts that end mid-block."""
    decode_rows = [(4, 1), (9, 1)]  # (num_computed, num_new): rows the prefill call must leave alone
    chunks = [(0, 5), (block_size, 20), (block_size + 3, 2 * block_size + 1), (0, 70)]
    check_prefill(decode_rows + chunks, heads, kv_heads, head_dim, block_size, len(decode_rows), 6, seed=4)


@pytest.mark.parametrize("heads, kv_heads", [(14, 2), (4, 4)])
def test_decode_rows_through_the_prefill_kernel_match_reference(heads, kv_heads):
    """A mixed step's short decode rows go through the prefill kernel with the prompts (TritonBackend.attend): a
    decode row is a chunk of one token after its context, in one launch with the chunks."""
    specs = [(4, 1), (40, 1), (150, 1), (0, 21), (33, 9)]  # (num_computed, num_new): three decode rows, two chunks
    check_prefill(specs, heads, kv_heads, 64, 16, 0, 12, seed=6)


def test_fp32_prefill_tries_one_small_tile_and_16_bit_dtypes_every_tile():
    """Exact fp32 dots on large tiles take minutes to compile on a GPU (each test shape would autotune all of them)."""
    configs = tile_configs(interpret=False)
    (only,) = prune_tiles(configs, {}, PRECISION="ieee")
    assert (only.kwargs["BLOCK_M"], only.kwargs["BLOCK_N"]) == (64, 32)
    assert prune_tiles(configs, {}, PRECISION="tf32") == configs and len(configs) == 8


@pytest.mark.parametrize("heads, kv_heads", [(14, 2), (4, 4)])
def test_prefill_after_long_prefixes_matches_reference(heads, kv_heads):
    """Prefixes of several key tiles (read without a mask), chunks of several query tiles ending mid-tile and
    mid-block: the unmasked tiles, the causal diagonal and the last partial tile all meet the reference."""
    check_prefill([(130, 45), (64, 64), (0, 33), (17, 100)], heads, kv_heads, 64, 16, 0, 12, seed=6)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="half-precision tl.dot needs a GPU (the interpreter is fp32)")
def test_bf16_kernels_match_fp32_reference_within_bf16_error():
    block_size, heads, kv_heads, head_dim = 16, 8, 2, 128
    k_pool, v_pool = (p.bfloat16() for p in make_pool(kv_heads, head_dim, block_size))
    seq_lens = [7, 300, 33]
    tables = random_tables(len(seq_lens), 48, 19)
    q = torch.randn(len(seq_lens), heads, head_dim).to(DEVICE, torch.bfloat16)
    got = paged_decode(q, k_pool, v_pool, tables, as_int32(seq_lens), block_size, max(seq_lens))
    want = torch.cat([reference(q[i:i + 1], k_pool, v_pool, tables[i], n, block_size) for i, n in enumerate(seq_lens)])
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
