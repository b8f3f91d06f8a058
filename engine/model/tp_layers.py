"""The tensor-parallel layers. Column-parallel layers (fused QKV, fused gate-up) need no layer of their own: each
rank's is a plain Linear over its output rows (engine/model/causal_lm.py sizes it from the TPLayout), with no
communication. What communicates:

- RowParallelLinear (o_proj, down_proj): the input features are split, each rank's partial product is summed
  with one all-reduce; the bias, where the model has one, lives on rank 0 only so it is added once.
- VocabParallelEmbedding: each rank looks up the ids of its vocabulary range (others give zero rows), one
  all-reduce assembles the embeddings.
- ParallelLMHead: each rank's logits over its vocabulary range; `gather` brings them to rank 0, where sampling
  runs, cut back to the real vocabulary (the last range's padding rows dropped).

With tensor_parallel_size 1 none of these is built: the model is exactly the single-device one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.linear import Linear
from engine.parallel.group import TPGroup
from engine.parallel.layout import TPLayout


@dataclass(frozen=True)
class TPShard:
    """What one rank's model is built from: which slice it holds, and the group it talks to."""

    layout: TPLayout
    group: TPGroup


class RowParallelLinear(Linear):
    """y = all_reduce(x_local @ W_local^T) (+ bias on rank 0). x: [T, in_features / size]; W_local holds the
    input columns of this rank's range."""

    def __init__(self, in_local: int, out_features: int, bias: bool, dtype: torch.dtype, shard: TPShard) -> None:
        super().__init__(in_local, out_features, bias=bias and shard.layout.rank == 0, device="meta", dtype=dtype)
        self.group = shard.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce_(super().forward(x))  # [T, out_features]


class VocabParallelEmbedding(nn.Module):
    """Embedding of the rows [vocab[0], vocab[1]) of the vocabulary (weight: [vocab_per_rank, hidden], padded)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, shard: TPShard) -> None:
        super().__init__()
        self.start, self.stop = shard.layout.vocab
        self.group = shard.group
        self.weight = nn.Parameter(torch.empty(shard.layout.vocab_per_rank, hidden_size, device="meta", dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start                                    # [T]
        outside = (local < 0) | (local >= self.stop - self.start)         # [T]
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)    # [T, hidden]
        return self.group.all_reduce_(rows.masked_fill_(outside.unsqueeze(1), 0))


class ParallelLMHead(Linear):
    """The LM head over this rank's vocabulary range: forward gives [S, vocab_per_rank] local logits."""

    def __init__(self, hidden_size: int, vocab_size: int, dtype: torch.dtype, shard: TPShard) -> None:
        super().__init__(hidden_size, shard.layout.vocab_per_rank, bias=False, device="meta", dtype=dtype)
        self.group, self.vocab_size = shard.group, vocab_size

    def gather(self, local_logits: torch.Tensor) -> torch.Tensor | None:
        """local_logits [S, vocab_per_rank] -> on rank 0 the whole [S, vocab]; None on the other ranks."""
        logits = self.group.gather_last_dim(local_logits)  # [S, size * vocab_per_rank] on rank 0
        if logits is None or logits.shape[-1] == self.vocab_size:
            return logits
        return logits[:, :self.vocab_size].contiguous()  # [S, vocab]
