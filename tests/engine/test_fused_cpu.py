"""The fused CPU kernels (engine/model/fused_cpu.py) against their torch references, and the model's use of them."""
import pytest
import torch

from engine.model import fused_cpu
from engine.model.layers import RMSNorm, RotaryEmbedding, apply_rotary
from engine.config import RopeScaling

pytestmark = pytest.mark.skipif(not fused_cpu.AVAILABLE, reason="numba is not installed")


@pytest.mark.parametrize("rows", [1, 7, fused_cpu.PARALLEL_ROWS, 300])   # the serial and the parallel launch
def test_add_rms_norm_adds_in_place_and_normalizes_like_the_reference(rows):
    gen = torch.Generator().manual_seed(rows)
    residual, delta = torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen) * 3
    weight = torch.rand(576, generator=gen) + 0.5
    expected, expected_sum = fused_cpu.add_rms_norm_reference(residual, delta, weight, 1e-5)
    before = residual.clone()
    out = fused_cpu.add_rms_norm_(residual, delta, weight, 1e-5)
    torch.testing.assert_close(residual, before + delta, rtol=0, atol=0)   # the same single rounding per element
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(expected_sum, residual, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [3, 100])
def test_rms_norm_leaves_its_input_alone(rows):
    x, weight = torch.randn(rows, 64) * 10, torch.randn(64)
    kept = x.clone()
    torch.testing.assert_close(fused_cpu.rms_norm(x, weight, 1e-6), fused_cpu.rms_norm_reference(x, weight, 1e-6),
                               rtol=2e-6, atol=1e-6)
    assert torch.equal(x, kept)


@pytest.mark.parametrize("rows", [2, 64])
def test_rotation_in_place_inside_the_qkv_output_matches_the_reference_exactly(rows):
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, RopeScaling(), torch.float32)
    cos, sin = rotary.lookup(torch.randint(0, 4096, (rows,)))
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)   # a strided view
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    expected = fused_cpu.rotate_reference(qk, cos, sin)
    rotated = apply_rotary(qk, cos, sin)
    assert rotated.data_ptr() == qkv.data_ptr()                          # in place, in the projection's output
    assert torch.equal(rotated, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


def test_the_norm_module_takes_the_fused_path_on_cpu_and_the_reference_elsewhere():
    norm = RMSNorm(32, 1e-6, torch.float32)
    norm.weight = torch.nn.Parameter(torch.rand(32) + 0.5)
    residual, delta = torch.randn(5, 32), torch.randn(5, 32)
    expected, expected_sum = fused_cpu.add_rms_norm_reference(residual, delta, norm.weight, 1e-6)
    out, summed = norm.add_and_norm(delta, residual)
    assert summed is residual                               # CPU float32: the sum written into the residual
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(summed, expected_sum, rtol=0, atol=0)
    half = torch.randn(5, 32, dtype=torch.bfloat16)         # not float32: the reference, nothing in place
    kept = half.clone()
    norm_bf16 = RMSNorm(32, 1e-6, torch.bfloat16)
    norm_bf16.weight = torch.nn.Parameter(torch.ones(32, dtype=torch.bfloat16))
    out, summed = norm_bf16.add_and_norm(half, half)
    assert torch.equal(half, kept) and summed is not half
