"""Checks shared by the engine tests."""
from __future__ import annotations

import random
import warnings

from engine import LLM


def assert_all_blocks_free(llm: LLM) -> None:
    engine = llm.engine
    assert engine.num_live_requests == 0, "requests still live in the engine"
    assert engine.num_free_blocks == engine.num_total_blocks, (
        f"KV blocks leaked: {engine.num_total_blocks - engine.num_free_blocks} still allocated")


def random_prompts(lengths, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, vocab_size) for _ in range(n)] for n in lengths]


def real_syncs(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    """The synchronizing operations torch's sync debug mode reported, without its one-time notice that the
    mode is a prototype."""
    return [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
