"""The sampler's row-wise picks on the device: the greedy argmax and the inverse-CDF draw, each in two levels
(per block of _BLOCK columns, then inside the chosen block), so a long row costs a pass of block reductions."""
from __future__ import annotations

import torch

_BLOCK = 1024  # columns per block in the two-level argmax and draw


def draw(probs: torch.Tensor, ids: torch.Tensor | None, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in two levels: the block whose cumulative mass passes u * total, then the column
    inside it, so a long row costs a summing pass, not a full cumsum. probs [R, n] >= 0, ids [R, n] or
    None (columns are token ids), uniforms [R] in [0, 1) -> token ids [R], -1 where there is no mass."""
    block_mass = _per_block(probs, lambda blocks: blocks.sum(dim=-1))  # [R, nb]
    block_cdf = block_mass.cumsum(dim=-1)  # [R, nb], non-decreasing
    total = block_cdf[:, -1:]  # [R, 1]
    target = _below(uniforms.unsqueeze(1) * total, total)  # [R, 1]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[-1] - 1)  # [R, 1]
    before = torch.nn.functional.pad(block_cdf, (1, 0)).gather(1, block)  # [R, 1]: earlier blocks' mass
    values, columns = _block_columns(probs, block, 0.0)  # [R, B]
    inner = values.cumsum(dim=-1)  # [R, B]
    residual = _below((target - before).clamp_(min=0.0), inner[:, -1:])  # [R, 1]
    inside = torch.searchsorted(inner, residual, right=True).clamp_(max=_BLOCK - 1)  # [R, 1]
    column = columns.gather(1, inside).clamp_(max=probs.shape[-1] - 1)  # [R, 1], in range even for NaN
    token = column if ids is None else ids.gather(1, column)  # [R, 1]
    valid = (total > 0) & torch.isfinite(total)  # [R, 1]
    return torch.where(valid, token, -1).squeeze(1)  # [R]


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, n] -> [S], the first maximum of each row as torch.argmax gives it. On CPU in two levels (block
    maxima, then inside the first best block): a fraction of argmax's time there. Elsewhere torch's own, one
    kernel: on a GPU the two levels would be 12 launches after every decode graph's replay."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    block = _per_block(logits, lambda blocks: blocks.amax(dim=-1)).argmax(dim=-1, keepdim=True)  # [S, 1]
    values, columns = _block_columns(logits, block, float("-inf"))  # [S, B]
    return columns.gather(1, values.argmax(dim=-1, keepdim=True)).squeeze(1)  # [S]


def _per_block(x: torch.Tensor, reduce) -> torch.Tensor:
    """x [R, n] -> [R, nb]: reduce(blocks [R, m, B]) over runs of _BLOCK columns, the last run short."""
    rows, n = x.shape
    full = n // _BLOCK * _BLOCK
    parts = [reduce(x[:, :full].reshape(rows, full // _BLOCK, _BLOCK))] if full else []
    if full < n:
        parts.append(reduce(x[:, full:].unsqueeze(1)))  # [R, 1]
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _block_columns(x: torch.Tensor, block: torch.Tensor, fill: float):
    """The values [R, B] of block [R, 1] of x [R, n] (fill past column n) and their columns [R, B]."""
    columns = block * _BLOCK + torch.arange(_BLOCK, device=x.device)  # [R, B]
    values = x.gather(1, columns.clamp(max=x.shape[-1] - 1))  # [R, B]
    return values.masked_fill(columns >= x.shape[-1], fill), columns


def _below(value: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """min(value, the largest float below bound): a target the cumulative mass is sure to pass."""
    return torch.minimum(value, torch.nextafter(bound, torch.zeros_like(bound)))
