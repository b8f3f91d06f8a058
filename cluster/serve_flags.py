"""The flag groups of `tandem serve` beside its main ones (cluster/serve.py): the API (served names, the
admission bound), the Ray cluster and the engine. Each group is added by one function, and the values
that need checking are read back by another (ValueError names the flag)."""
from __future__ import annotations

import argparse

from engine.config import ATTENTION_BACKENDS, EngineConfig


def add_api_arguments(group) -> None:
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the names the API serves the model under: every one is accepted as `model`, the "
                            "first is the one reported (/v1/models lists them all); default: the --model path")
    group.add_argument("--max-pending-requests", type=int, default=256,
                       help="requests in the system at once, from both front ends, in every mode; past it: "
                            "429 / RESOURCE_EXHAUSTED")


def served_names_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """--served-model-name as a tuple (empty when not given); ValueError for empty or repeated names, and
    for --max-pending-requests below 1."""
    names = tuple(args.served_model_name or ())
    if any(not name.strip() for name in names) or len(set(names)) != len(names):
        raise ValueError(f"--served-model-name takes distinct non-empty names, got {list(names)}")
    if args.max_pending_requests < 1:
        raise ValueError("--max-pending-requests must be >= 1")
    return names


def add_ray_arguments(group) -> None:
    group.add_argument("--node-ip-address", default=None,
                       help="with --address: the address of this machine's Ray node (as `ray start "
                            "--node-ip-address` was given), when it is not the one Ray would pick")
    for role in ("prefill", "decode"):
        group.add_argument(f"--{role}-resources", default=None,
                           help=f"JSON object of custom Ray resources each {role} worker's bundle also takes, "
                                f"e.g. '{{\"{role}_pool\": 1}}': {role} workers run only on nodes that have them")


def add_engine_arguments(group) -> None:
    defaults = EngineConfig()
    group.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                       help="token budget of one engine step")
    group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    group.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=defaults.enable_chunked_prefill,
                       help="split long prompts across steps (off: max-num-batched-tokens >= max-model-len)")
    group.add_argument("--long-prefill-token-threshold", type=int, default=defaults.long_prefill_token_threshold,
                       help="cap on one prompt's tokens per step, so prompts queued behind a long one join "
                            "the same step (0: off)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=defaults.enable_prefix_caching)
    group.add_argument("--block-size", type=int, default=defaults.block_size)
    group.add_argument("--kv-cache-memory-mib", type=int, default=None,
                       help="KV pool size per engine in MiB (CPU default 1024; GPU default: the memory plan, "
                            "what --gpu-memory-utilization leaves after weights, activations and CUDA graphs)")
    group.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization,
                       help="share of the GPU an engine may fill, KV pool included")
    group.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=defaults.attention_backend,
                       help="auto: triton on CUDA, the numba kernel on CPU float32, torch otherwise")
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine flags describe (its own checks raise ValueError)."""
    if args.kv_cache_memory_mib is not None and args.kv_cache_memory_mib < 1:
        raise ValueError("--kv-cache-memory-mib must be >= 1")
    memory = None if args.kv_cache_memory_mib is None else args.kv_cache_memory_mib << 20
    return EngineConfig(block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        enable_chunked_prefill=args.enable_chunked_prefill,
                        long_prefill_token_threshold=args.long_prefill_token_threshold,
                        enable_prefix_caching=args.enable_prefix_caching, kv_cache_memory=memory,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager)
