"""Two prefixes built to collide under the prefix cache's old block hash, `hash((parent, tuple(tokens)))`.

CPython hashes an int n to n mod (2**61 - 1) (keeping its sign) and a tuple with xxHash lanes, which can be
run backwards. So for a first block A0 we can build a different first block B0 whose chained hash differs
from A0's by exactly 2**61 - 1: two distinct dict keys, yet as the parent of the next block they hash alike,
so under the old scheme the block after B0 is found at the block after A0 (another prompt's KV).
"""
from __future__ import annotations

MASK = (1 << 64) - 1
MODULUS = (1 << 61) - 1
PRIME_1, PRIME_2, PRIME_5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
LENGTH_SALT = PRIME_5 ^ 3527539


def old_chain_hash(parent, tokens) -> int:
    """The prefix cache's block hash before it became sha256."""
    return hash((parent, tuple(tokens)))


def tuple_hash(items) -> int:
    """CPython's tuple hash (3.8+), recomputed from the items' hashes (checks the model below)."""
    acc = (_acc_after([hash(x) & MASK for x in items]) + (len(items) ^ LENGTH_SALT)) & MASK
    return 1546275796 if acc == MASK else _signed(acc)


def colliding_first_blocks(block_size: int) -> tuple[list[int], list[int]]:
    """Two first blocks (A0, B0) built as colliding_first_block explains (hash(None), part of every first
    block's hash, differs between processes, so some A0 leave no room for a twin: try the next)."""
    for first in range(1, 1000):
        a0 = [first] + list(range(2, block_size + 1))
        try:
            return a0, colliding_first_block(a0)
        except ValueError:
            continue
    raise AssertionError("no first block has a twin")


def colliding_first_block(first_block: list[int]) -> list[int]:
    """A first block (same length, different ints) whose old hash is first_block's +- 2**61 - 1."""
    h = old_chain_hash(None, first_block)
    target = h + MODULUS if h > 0 else h - MODULUS  # same sign, so hash(target) == hash(h)
    if not -(1 << 63) < target < (1 << 63):
        raise ValueError("pick another first block: its hash leaves no room for a twin")
    inner = _last_lane_for([hash(None) & MASK], 2, target)
    return _block_with_hash(inner, len(first_block))


def _block_with_hash(target: int, block_size: int) -> list[int]:
    for first in range(10_000):
        lanes = [first] + [0] * (block_size - 2)
        lane = _last_lane_for([hash(x) & MASK for x in lanes], block_size, target)
        if abs(lane) < MODULUS and lane != -1:  # an int whose hash is exactly `lane`
            return [*lanes, lane]
    raise AssertionError("no block found")


def _last_lane_for(prefix_lanes: list[int], length: int, target: int) -> int:
    """The hash the last item of a `length`-tuple must have for the tuple to hash to `target`."""
    acc = (target - (length ^ LENGTH_SALT)) & MASK
    acc = _rotr(acc * pow(PRIME_1, -1, 1 << 64) & MASK, 31)
    return _signed((acc - _acc_after(prefix_lanes)) * pow(PRIME_2, -1, 1 << 64) & MASK)


def _acc_after(lanes: list[int]) -> int:
    acc = PRIME_5
    for lane in lanes:
        acc = _rotl((acc + lane * PRIME_2) & MASK, 31) * PRIME_1 & MASK
    return acc


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & MASK


def _rotr(x: int, r: int) -> int:
    return ((x >> r) | (x << (64 - r))) & MASK


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x
