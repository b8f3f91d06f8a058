"""Issue 27, item 5: nothing compiled while serving. Every Triton kernel launched with the integers that change from
step to step (batch size, first sequence, row counts, context lengths, partition count and size, the block tables'
width, metadata views at 8-byte offsets of the staging buffer) needs one compiled variant: each launch's cache key,
computed by Triton's own binder (tests/support/triton_specialisations.py), is the same. On CPU the kernels run
under the interpreter; the keys are what a GPU would compile. And every kernel compiles for a Hopper GPU with Triton's
own compiler, which needs no GPU."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from engine.attention import triton_decode, triton_prefill, triton_store  # noqa: E402
from engine.model import fused_triton  # noqa: E402
from tests.support.engines import TEST_DEVICE as DEVICE  # noqa: E402
from tests.support.triton_specialisations import SpecialisationRecorder  # noqa: E402

BLOCK, HEADS, KV_HEADS, HEAD_DIM, BLOCKS = 16, 8, 2, 64, 80


def pools(head_dim=HEAD_DIM):
    gen = torch.Generator().manual_seed(0)
    shape = (BLOCKS * BLOCK, KV_HEADS, head_dim)
    return torch.randn(shape, generator=gen).to(DEVICE), torch.randn(shape, generator=gen).to(DEVICE)


def int32_at(values, offset):
    """values as an int32 view starting `offset` elements into a buffer (staging views are 8-byte aligned only)."""
    buffer = torch.zeros(offset + len(values), dtype=torch.int32, device=DEVICE)
    buffer[offset:] = torch.tensor(values, dtype=torch.int32)
    return buffer[offset:]


def tables(rows, width):
    return (torch.arange(rows * width) % BLOCKS).to(torch.int32).reshape(rows, width).to(DEVICE)  # [N, width]


def decode(seq_lens, offset, num_partitions=None, head_dim=HEAD_DIM):
    k_pool, v_pool = pools(head_dim)
    q = torch.randn(len(seq_lens), HEADS, head_dim, device=DEVICE)
    width = -(-max(seq_lens) // BLOCK)
    triton_decode.paged_decode(q, k_pool, v_pool, tables(len(seq_lens), width), int32_at(seq_lens, offset), BLOCK,
                               max(seq_lens), num_partitions=num_partitions)


def prefill(specs, decode_rows, offset):
    """specs: (num_computed, num_new) per sequence, the first decode_rows of them single tokens."""
    k_pool, v_pool = pools()
    starts = [0]
    for _, n in specs:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], HEADS, HEAD_DIM, device=DEVICE)
    seq_lens = [c + n for c, n in specs]
    triton_prefill.paged_prefill(torch.empty_like(q), q, k_pool, v_pool, tables(len(specs), -(-max(seq_lens) // BLOCK)),
                                 int32_at(starts, offset), int32_at(seq_lens, offset), decode_rows,
                                 len(specs) - decode_rows, max(n for _, n in specs[decode_rows:]), BLOCK)


def test_decode_compiles_once_for_any_batch_context_and_partitioning():
    with SpecialisationRecorder(triton_decode) as rec:
        decode([1], offset=0)                                  # one row, one partition, a one-block table
        decode([17, 3, 300], offset=1, num_partitions=10)      # 10 partitions, tables 19 wide
        decode([1200, 40], offset=2, num_partitions=38)        # 38 partitions: the merge loops over them
        decode([5, 6, 7, 8, 9], offset=3)
    assert {name: len(keys) for name, keys in rec.keys.items()} == {"_decode_partition_kernel": 1, "_merge_kernel": 1}


def test_prefill_compiles_once_for_any_chunks_and_first_sequence():
    with SpecialisationRecorder(triton_prefill) as rec:
        prefill([(0, 20)], decode_rows=0, offset=0)                                     # a pure prefill step
        prefill([(4, 1), (0, 16)], decode_rows=1, offset=1)                             # first_seq 1, a 16-wide tile
        prefill([(4, 1), (9, 1), (33, 70), (0, 5)], decode_rows=2, offset=3)           # a mixed step
        prefill([(0, 1), (5, 1), (6, 1), (160, 17)], decode_rows=3, offset=2)
    assert {name: len(keys) for name, keys in rec.keys.items()} == {"_prefill_kernel": 1}


def test_layer_kernels_compile_once_for_any_token_count():
    with SpecialisationRecorder(triton_store, fused_triton) as rec:
        for tokens, offset in ((1, 0), (16, 1), (7, 3)):
            q, k, v = (torch.randn(tokens, h, HEAD_DIM, device=DEVICE) for h in (HEADS, KV_HEADS, KV_HEADS))
            k_pool, v_pool = pools()
            slots = torch.zeros(offset + tokens, dtype=torch.int64, device=DEVICE)[offset:]
            slots[:] = torch.arange(tokens)
            triton_store.store_kv(k, v, k_pool, v_pool, slots)
            cos = sin = torch.ones(tokens, 1, HEAD_DIM, device=DEVICE)
            fused_triton.rotary_store_(q, k, v, cos, sin, k_pool, v_pool, slots)
            hidden, weight = torch.randn(tokens, 96, device=DEVICE), torch.ones(96, device=DEVICE)
            fused_triton.rms_norm(hidden, weight, 1e-6)
            fused_triton.add_rms_norm_(hidden, torch.randn(tokens, 96, device=DEVICE), weight, 1e-6)
            fused_triton.silu_mul(torch.randn(tokens, 2 * 40, device=DEVICE), 40)
    counts = {name: len(keys) for name, keys in rec.keys.items()}
    # rms_norm with and without the residual add: two variants of one kernel, fixed by the model, not the step
    assert counts == {"_store_kv_kernel": 1, "_rotary_store_kernel": 1, "_rms_norm_kernel": 2, "_silu_mul_kernel": 1}


def test_the_recorder_sees_a_new_variant_where_one_is_compiled():
    """What the tests above rule out does show: a constexpr that differs (the head size) is a second key."""
    with SpecialisationRecorder(triton_decode) as rec:
        decode([5, 9], offset=0)
        decode([5, 9], offset=0, head_dim=32)
    assert len(rec.keys["_decode_partition_kernel"]) == 2


def _ptxas_available() -> bool:
    import triton
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return bundled.exists() or shutil.which("ptxas") is not None


@pytest.mark.skipif(not _ptxas_available(), reason="no ptxas to compile for a GPU with")
def test_every_kernel_compiles_for_a_hopper_gpu(tmp_path):
    """The interpreter runs code the compiler may reject: every kernel as the engine launches it (bfloat16, GQA 7,
    head_dim 128; the prefill kernel with its smallest and largest tile) through Triton's compiler for sm_90."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run([sys.executable, "-m", "tests.support.triton_compile_check"], env=env, text=True,
                            capture_output=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    compiled = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert sorted(set(compiled)) == ["_decode_partition_kernel", "_merge_kernel", "_prefill_kernel", "_rms_norm_kernel",
                                     "_rotary_store_kernel", "_silu_mul_kernel", "_store_kv_kernel"], result.stdout
