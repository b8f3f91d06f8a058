"""EngineStats: running counters of what the engine computed, for tests, benchmarks and /metrics."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Cumulative since the engine started. A prompt token served from the prefix cache is never
    counted in num_prefill_tokens: that is how tests see that the cache saved work."""

    num_steps: int = 0
    num_prefill_tokens: int = 0     # tokens computed in chunks of more than one token, or a 1-token prompt
    num_decode_tokens: int = 0      # single tokens that follow an already-computed context
    num_batched_tokens: int = 0     # all tokens of all forwards
    forward_seconds: float = 0.0

    def record_step(self, chunks, seconds: float) -> None:
        self.num_steps += 1
        self.forward_seconds += seconds
        for chunk in chunks:
            self.num_batched_tokens += chunk.num_new_tokens
            if chunk.seq.num_computed_tokens - chunk.num_new_tokens >= chunk.seq.num_prompt_tokens:
                self.num_decode_tokens += chunk.num_new_tokens
            else:
                self.num_prefill_tokens += chunk.num_new_tokens
