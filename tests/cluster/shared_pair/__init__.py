"""Tests sharing one disaggregated pair of workers (1 prefill + 1 decode) of the tiny Llama checkpoint (conftest.py)."""

POOL_BYTES = 4 << 20   # each engine's KV pool: 512 blocks of the tiny llama
