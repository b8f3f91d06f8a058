"""The fused layer kernels (engine/model/fused_triton.py) against their torch references, float32 and
bfloat16, odd sizes, an empty batch; on CPU tensors under Triton's interpreter (tests/conftest.py), on CUDA
where there is a GPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from engine.model import fused_triton as ft  # noqa: E402
from engine.model.fused_cpu import add_rms_norm_reference, rms_norm_reference  # noqa: E402
from tests.support.engines import TEST_DEVICE as DEVICE  # noqa: E402

DTYPES = [torch.float32, torch.float16,  # bfloat16's arithmetic is wrong under the interpreter (numpy has none)
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a GPU"))]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: equal to rounding; 16-bit: within its last bit or two (one rounding inside the kernel where
    torch rounds after each op)."""
    tol = dict(atol=1e-5, rtol=1e-5) if got.dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(0, 64), (1, 48), (5, 100), (3, 896)])
def test_rms_norm_and_its_fused_residual_add(dtype, tokens, hidden):
    x, delta, weight = randn(tokens, hidden, dtype=dtype, seed=1), randn(tokens, hidden, dtype=dtype, seed=2), \
        randn(hidden, dtype=dtype, seed=3)
    close(ft.rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))
    want_norm, want_sum = add_rms_norm_reference(x, delta, weight, 1e-6)
    residual = x.clone()
    close(ft.add_rms_norm_(residual, delta, weight, 1e-6), want_norm)
    assert torch.equal(residual, want_sum), "the residual sum is written in place, in its own dtype"


def test_a_residual_whose_rows_are_strided_is_refused():
    residual = torch.zeros(4, 16, device=DEVICE).t()
    with pytest.raises(ValueError, match="rows must be contiguous"):
        ft.add_rms_norm_(residual, torch.zeros(16, 4, device=DEVICE), torch.ones(4, device=DEVICE), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, intermediate", [(0, 32), (1, 40), (4, 1500)])
def test_silu_mul(dtype, tokens, intermediate):
    gate_up = randn(tokens, 2 * intermediate, dtype=dtype, seed=4)
    close(ft.silu_mul(gate_up, intermediate), ft.silu_mul_reference(gate_up, intermediate))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 16), (14, 2, 64), (8, 1, 24)])
def test_rotary_and_kv_store_in_one_launch(dtype, heads, kv_heads, head_dim):
    tokens, slots = 6, 40
    q, k, v = (randn(tokens, h, head_dim, dtype=dtype, seed=s) for s, h in ((5, heads), (6, kv_heads), (7, kv_heads)))
    angles = randn(tokens, 1, head_dim // 2, dtype=torch.float32, seed=8).repeat(1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slot_mapping = torch.tensor([3, 17, -1, 0, 39, 21], device=DEVICE)  # -1: a padding row, never written
    pools = [torch.full((slots, kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE) for _ in range(4)]
    want_q, want_k = q.clone(), k.clone()
    ft.rotary_store_reference(want_q, want_k, v, cos, sin, pools[0], pools[1], slot_mapping)
    ft.rotary_store_(q, k, v, cos, sin, pools[2], pools[3], slot_mapping)
    close(q, want_q)
    close(k, want_k)
    close(pools[2], pools[0])
    assert torch.equal(pools[3], pools[1]), "V is copied as it is"
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[[3, 17, 0, 39, 21]] = False
    assert bool((pools[2][untouched.to(DEVICE)] == 7.0).all()), "a slot no token maps to was written"
