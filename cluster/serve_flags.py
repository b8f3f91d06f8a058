"""The flag groups of `tandem serve` beside its main ones (cluster/serve.py): the API (served names, the
admission bound, the HTTP read deadline and connection cap), the Ray cluster, the engine, scaling (the
worker set's bounds, the autoscaler) and which KV transfers ride the control connection; and the serving
mode with its worker counts, read from the main flags.
Each group is added by one function, and the values that need checking are read back by another (ValueError
names the flag)."""
from __future__ import annotations

import argparse

from cluster.coordinator.autoscaler import AutoscalePolicy
from cluster.workers.worker_bounds import WorkerBounds
from engine.config import ATTENTION_BACKENDS, PREFILL_FIRST_MODES, EngineConfig

# Serving: while requests decode, a step takes at most this many prompt tokens (one 512-token prompt), so a decode
# waits at most one such step's prompt work between two tokens: ~0.5-1 s on 2 CPU cores (docs/architecture.md,
# "Steps"); on a GPU, where the H200 run saw a 683 ms step when a 16k prompt came in beside 256 decodes of an 8B
# shape, a 512-token chunk is ~14 ms of matmuls there (issue 27's bound: no step over 150 ms).
SERVING_PREFILL_BOUND = 512


def add_api_arguments(group) -> None:
    """The front ends' flags: where they listen, the API key, the names served, the bounds on what comes in."""
    group.add_argument("--host", default="127.0.0.1", help="address the HTTP and gRPC front ends listen on")
    group.add_argument("--grpc-port", type=int, default=50051)
    group.add_argument("--http-port", type=int, default=8000)
    group.add_argument("--api-key", default=None, help="require this key on gRPC and HTTP requests")
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the names the API serves the model under: every one is accepted as `model`, the "
                            "first is the one reported (/v1/models lists them all); default: the --model path")
    group.add_argument("--max-pending-requests", type=int, default=256,
                       help="requests in the system at once, from both front ends, in every mode; past it: "
                            "429 / RESOURCE_EXHAUSTED")
    group.add_argument("--request-read-timeout-s", type=float, default=30.0,
                       help="HTTP: a request body (or chunked upload) must arrive whole within this many seconds "
                            "of its first read, or it is answered 408 and its connection closed")
    group.add_argument("--max-connections", type=int, default=1024,
                       help="HTTP: connections served at once; a connection past it gets 503 (code "
                            "too_many_connections, Retry-After: 1) to its first request without reaching the "
                            "API, and is closed (uvicorn's --limit-concurrency, nginx's limit_conn)")


def served_names_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """--served-model-name as a tuple (empty when not given); ValueError for empty or repeated names, and
    for --max-pending-requests below 1."""
    names = tuple(args.served_model_name or ())
    if any(not name.strip() for name in names) or len(set(names)) != len(names):
        raise ValueError(f"--served-model-name takes distinct non-empty names, got {list(names)}")
    if args.max_pending_requests < 1:
        raise ValueError("--max-pending-requests must be >= 1")
    return names


def http_limits_from_args(args: argparse.Namespace) -> dict:
    """ServeConfig's request_read_timeout_s and max_connections from their flags; ValueError names a flag out
    of range."""
    if not 0 < args.request_read_timeout_s <= 3600:
        raise ValueError("--request-read-timeout-s must be in (0, 3600]")
    if args.max_connections < 1:
        raise ValueError("--max-connections must be >= 1")
    return {"request_read_timeout_s": args.request_read_timeout_s, "max_connections": args.max_connections}


def mode_and_workers_from_args(args: argparse.Namespace) -> tuple[str, int, int, int]:
    """(mode, prefill workers, decode workers, replicas). Worker counts without --mode: disaggregated;
    --replicas N (colocated implied): 0 prefill + N decode-side workers; neither: the in-process engine."""
    prefill_workers, replicas = args.prefill_workers, args.replicas
    mode = args.mode or ("disaggregated" if prefill_workers else "colocated")  # worker counts given: disaggregated
    if replicas < 0:
        raise ValueError("--replicas must be >= 0 (0: one colocated engine in this process)")
    if replicas and (mode != "colocated" or prefill_workers or args.decode_workers != 1):
        raise ValueError("--replicas N is colocated serving (N engines on Ray, each doing both phases): it takes "
                         "no --prefill-workers or --decode-workers, and not --mode disaggregated")
    if mode == "colocated":
        if prefill_workers or args.decode_workers != 1:
            raise ValueError("colocated serving runs one engine in this process (or --replicas N on Ray): use "
                             "--decode-workers 1 and no --prefill-workers, or --mode disaggregated")
        if args.address is not None and not replicas:
            raise ValueError("--address (a Ray cluster) needs --mode disaggregated or --replicas N")
        return mode, 0, replicas or 1, replicas
    prefill_workers = prefill_workers or 1
    if prefill_workers < 1 or args.decode_workers < 1:
        raise ValueError("disaggregated serving needs --prefill-workers >= 1 and --decode-workers >= 1")
    return mode, prefill_workers, args.decode_workers, 0


def add_kv_inline_argument(parser) -> None:
    parser.add_argument("--kv-inline-max-mib", type=float, default=None,
                        help="transport gloo: only transfers of at most this many MiB travel on the pair's "
                             "authenticated control connection, larger ones on a gloo process group, whose listener "
                             "Tandem cannot authenticate (default: every transfer inline, no gloo listener ever; "
                             "docs/architecture.md)")


def kv_inline_bytes_from_args(args: argparse.Namespace, mode: str) -> int | None:
    """--kv-inline-max-mib in bytes (TransferConfig.inline_max_bytes; None: every transfer); ValueError out of
    range or off its mode."""
    if args.kv_inline_max_mib is None:
        return None
    if not 0 <= args.kv_inline_max_mib <= 1024:
        raise ValueError(f"--kv-inline-max-mib must be in [0, 1024], got {args.kv_inline_max_mib}")
    if mode == "colocated":
        raise ValueError("--kv-inline-max-mib needs --mode disaggregated (colocated engines move no KV)")
    return int(args.kv_inline_max_mib * 2**20)


def add_tp_arguments(group) -> None:
    """Tensor parallelism: how many ranks (GPUs, or CPU shares) each engine is split over."""
    group.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=None,
                       help="colocated: each replica (or the one engine in this process) is a tensor-parallel group "
                            "of N ranks, one GPU (or --cpu-threads CPUs) each, on one node (default 1)")
    for role in ("prefill", "decode"):
        group.add_argument(f"--{role}-tp", type=int, default=None,
                           help=f"disaggregated: the tensor-parallel size of each {role} worker (default 1); the KV "
                                "moves between the two layouts through each group's rank 0")


def tp_sizes_from_args(args: argparse.Namespace, mode: str) -> dict[str, int]:
    """ServeConfig's prefill_tp and decode_tp from --tp / --prefill-tp / --decode-tp; ValueError names a flag
    below 1 or one the mode does not take."""
    for flag in ("tp", "prefill_tp", "decode_tp"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if mode == "colocated":
        for flag in ("prefill_tp", "decode_tp"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} sizes disaggregated workers; colocated "
                                 "serving (--replicas N, or the engine in this process) takes --tp N")
        return {"prefill_tp": 1, "decode_tp": args.tp or 1}
    if args.tp is not None:
        raise ValueError("--tp N sizes colocated engines (--replicas N); disaggregated workers take --prefill-tp A "
                         "and --decode-tp B")
    return {"prefill_tp": args.prefill_tp or 1, "decode_tp": args.decode_tp or 1}


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
    group.add_argument("--max-prefill-tokens-while-decoding", type=int, default=None,
                       help="while requests decode, no step takes more prompt tokens than this: the longest "
                            f"wait between two tokens (0: --max-num-batched-tokens; default {SERVING_PREFILL_BOUND})")
    group.add_argument("--prefill-backlog-steps", type=int, default=defaults.prefill_backlog_steps,
                       help="N > 0: a step beside decodes may take 1/N of the prompt tokens still to compute "
                            "when that is more than the bound (a backlog is worked down in about N steps); "
                            "0: the bound always holds (default %(default)s)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=defaults.enable_prefix_caching)
    group.add_argument("--block-size", type=int, default=defaults.block_size)
    group.add_argument("--kv-cache-memory-mib", type=int, default=None,
                       help="KV pool size per engine in MiB (CPU default: a share of the host's available memory, "
                            "cluster/workers/host_memory.py; GPU default: the memory plan, what "
                            "--gpu-memory-utilization leaves after weights, activations and CUDA graphs)")
    group.add_argument("--kv-cache-resident", action=argparse.BooleanOptionalAction, default=True,
                       help="CPU: commit the KV pool's pages at start (~0.35 s a GiB), so no request waits on the "
                            "page faults of a first write; --no-kv-cache-resident commits them as written")
    group.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization,
                       help="share of the GPU an engine may fill, KV pool included")
    group.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=defaults.attention_backend,
                       help="auto: triton on CUDA, the numba kernel on CPU float32, torch otherwise")
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs at all")
    group.add_argument("--mixed-graph-max-tokens", type=int, default=defaults.mixed_graph_max_tokens, metavar="N",
                       help="CUDA: steps that hold prompt chunks, of up to N tokens, replay piecewise graphs with "
                            "the attention eager between them (0: they run eager)")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="schedule step N + 1 while the device runs step N, whose picks feed it on the device "
                            "(same outputs; default: on for CUDA with one rank, off on CPU)")
    group.add_argument("--prefill-first", choices=PREFILL_FIRST_MODES, default=defaults.prefill_first,
                       help="on: while sequences decode, waiting prompts one step finishes get a step of "
                            "their own before the decodes' next token (never two in a row); off: mixed into the "
                            "decode step; auto: on for CPU, off for CUDA")
    add_tp_arguments(group)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine flags describe (its own checks raise ValueError)."""
    if args.kv_cache_memory_mib is not None and args.kv_cache_memory_mib < 1:
        raise ValueError("--kv-cache-memory-mib must be >= 1")
    memory = None if args.kv_cache_memory_mib is None else args.kv_cache_memory_mib << 20
    prefill_bound = args.max_prefill_tokens_while_decoding
    prefill_bound = SERVING_PREFILL_BOUND if prefill_bound is None else prefill_bound
    return EngineConfig(block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        enable_chunked_prefill=args.enable_chunked_prefill,
                        long_prefill_token_threshold=args.long_prefill_token_threshold,
                        max_prefill_tokens_while_decoding=prefill_bound,
                        prefill_backlog_steps=args.prefill_backlog_steps,
                        enable_prefix_caching=args.enable_prefix_caching, kv_cache_memory=memory,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                        mixed_graph_max_tokens=args.mixed_graph_max_tokens, prefill_first=args.prefill_first,
                        async_scheduling=args.async_scheduling, kv_cache_resident=args.kv_cache_resident)


BOUND_FLAGS = ("min_prefill_workers", "max_prefill_workers", "min_decode_workers", "max_decode_workers",
               "min_replicas", "max_replicas")
AUTOSCALE_FLAGS = {"autoscale_interval_s": "interval_s", "autoscale_cooldown_s": "cooldown_s",
                   "autoscale_window_s": "window_s", "ttft_slo_ms": "ttft_slo_ms", "itl_slo_ms": "itl_slo_ms",
                   "autoscale_prefill_queue_tokens": "prefill_queue_tokens",
                   "autoscale_decode_occupancy": "decode_occupancy"}


def add_scaling_arguments(group) -> None:
    """Bounds of the worker set (admin calls and the autoscaler stay within them), the drain timeout and
    the autoscaler. The worker counts given at start must lie within the bounds."""
    for role, what in (("prefill-workers", "prefill workers"), ("decode-workers", "decode workers"),
                       ("replicas", "colocated replicas")):
        group.add_argument(f"--min-{role}", type=int, default=None, help=f"fewest {what} while serving (default 1)")
        group.add_argument(f"--max-{role}", type=int, default=None,
                           help=f"most {what} while serving (default: what the Ray cluster's nodes hold; a number "
                                f"lets added workers wait for nodes the Ray autoscaler adds)")
    group.add_argument("--drain-timeout-s", type=float, default=300.0,
                       help="how long a drained worker's requests may run before those left migrate to other workers")
    group.add_argument("--autoscale", action="store_true",
                       help="add and drain workers by load (needs --max-* for every role of the mode)")
    policy = AutoscalePolicy()
    for flag, field, text in (
            ("--autoscale-interval-s", "interval_s", "seconds between two decisions"),
            ("--autoscale-cooldown-s", "cooldown_s", "seconds a role waits after a change before the next"),
            ("--autoscale-window-s", "window_s", "the latency percentiles' window in seconds"),
            ("--ttft-slo-ms", "ttft_slo_ms", "TTFT p90 goal: above it prefill workers (replicas) are added"),
            ("--itl-slo-ms", "itl_slo_ms", "inter-token latency p90 goal: above it decode workers (replicas) are "
             "added"),
            ("--autoscale-prefill-queue-tokens", "prefill_queue_tokens",
             "prompt tokens waiting per prefill worker (replica) above which one is added"),
            ("--autoscale-decode-occupancy", "decode_occupancy",
             "running requests / what the decode workers (replicas) hold, above which one is added")):
        kind = int if field == "prefill_queue_tokens" else float
        group.add_argument(flag, type=kind, default=None, help=f"{text} (default {getattr(policy, field):g})")


def scaling_from_args(args: argparse.Namespace, num_prefill: int, num_decode: int,
                      on_ray: bool) -> tuple[WorkerBounds, AutoscalePolicy | None]:
    """The bounds and the autoscale policy (None without --autoscale) the flags describe, for a cluster of
    num_prefill (0: replicas) and num_decode workers at start; ValueError names the flag at fault."""
    given = [name for name in (*BOUND_FLAGS, *AUTOSCALE_FLAGS) if getattr(args, name) is not None]
    given += ["autoscale"] if args.autoscale else []
    if given and not on_ray:
        raise ValueError(f"--{given[0].replace('_', '-')} needs workers on Ray (--replicas N, or disaggregated)")
    if args.drain_timeout_s <= 0:
        raise ValueError("--drain-timeout-s must be > 0")
    roles = [("replicas", num_decode)] if not num_prefill else [("prefill_workers", num_prefill),
                                                                 ("decode_workers", num_decode)]
    present = {role for role, _ in roles}
    for name in given:
        if name in BOUND_FLAGS and name.split("_", 1)[1] not in present:
            raise ValueError(f"--{name.replace('_', '-')} does not apply: this mode's workers are "
                             + " and ".join(role.replace("_", " ") for role in present))
    limits = {role: _role_bounds(args, role, count) for role, count in roles}
    if args.autoscale:
        missing = [role for role, (_, high) in limits.items() if high is None]
        if missing:
            raise ValueError(f"--autoscale needs --max-{missing[0].replace('_', '-')}: how far it may add")
    elif [name for name in given if name in AUTOSCALE_FLAGS]:
        raise ValueError(f"--{[n for n in given if n in AUTOSCALE_FLAGS][0].replace('_', '-')} needs --autoscale")
    decode = limits.get("decode_workers") or limits["replicas"]
    prefill = limits.get("prefill_workers", (1, None))
    bounds = WorkerBounds(prefill[0], prefill[1], decode[0], decode[1])
    if not args.autoscale:
        return bounds, None
    try:
        return bounds, AutoscalePolicy(**{field: getattr(args, flag) for flag, field in AUTOSCALE_FLAGS.items()
                                          if getattr(args, flag) is not None})
    except ValueError as error:
        raise ValueError(f"autoscale flags: {error} (the --autoscale-* / --*-slo-ms flag of that name)") from None


def _role_bounds(args: argparse.Namespace, role: str, count: int) -> tuple[int, int | None]:
    """(min, max) of --min-<role> / --max-<role>, checked against each other and the start count."""
    low, high = getattr(args, f"min_{role}"), getattr(args, f"max_{role}")
    flag = role.replace("_", "-")
    low = 1 if low is None else low
    if low < 1:
        raise ValueError(f"--min-{flag} must be >= 1")
    if high is not None and high < low:
        raise ValueError(f"--max-{flag} ({high}) must be >= --min-{flag} ({low})")
    if count < low or (high is not None and count > high):
        raise ValueError(f"the {count} {flag.replace('-', ' ')} at start must be within --min-{flag} {low} and "
                         f"--max-{flag} {'(none)' if high is None else high}")
    return low, high
