"""`tandem plan`'s flags and their checks: the hardware (a budget of devices, the TP size of each role), the
serving path's engines, the host; ValueError names the flag that is wrong, before anything is profiled."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from cluster.plan.deployment import check_tp_sizes
from cluster.plan.engine_sim import EngineLimits
from cluster.plan.host_model import SCHEDULERS, SLICED
from cluster.plan.profile import GRIDS
from cluster.plan.tp_model import TpCost, parse_tp_cost
from cluster.plan.workload import add_workload_arguments


@dataclass(frozen=True)
class Hardware:
    """What the plan splits: `devices` (GPUs, or CPU worker shares of `threads` torch threads each: one per rank)
    and the TP size of every prefill worker, decode worker and colocated replica."""

    device: str
    devices: int
    threads: int
    prefill_tp: int = 1
    decode_tp: int = 1
    replica_tp: int = 1

    @property
    def unit(self) -> str:
        return "GPUs" if self.device == "cuda" else "devices"

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        """The TP sizes > 1 the deployments use (each needs a TpCost)."""
        return tuple(sorted({self.prefill_tp, self.decode_tp, self.replica_tp} - {1}))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of `tandem plan` on `parser` (cluster/cli.py calls it through cluster.plan.command)."""
    parser.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded model)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--gpus", "--devices", "--workers", type=int, default=None, dest="workers",
                        help="devices to split: GPUs (one per rank), or CPU shares of --cpu-threads each; a worker "
                             "of TP size T takes T (default: the GPUs, else 4 with 8 cores or 2, as `tandem bench "
                             "compare`)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch threads per CPU device share (per rank; default: cores / devices, at least 1)")
    parser.add_argument("--ttft-slo-ms", type=float, required=True, help="time to first token target")
    parser.add_argument("--itl-slo-ms", type=float, required=True,
                        help="inter-token latency target, held against each request's mean (vLLM's TPOT)")
    parser.add_argument("--slo-attainment", type=float, default=0.9,
                        help="share of requests that must meet both SLOs for a deployment to meet them")
    add_workload_arguments(parser)
    add_engine_arguments(parser)
    add_tp_arguments(parser)
    parser.add_argument("--transfer-gbps", type=float, default=None,
                        help="KV transfer bandwidth in GB/s (default: measured with `tandem bench transfer`)")
    parser.add_argument("--transfer-latency-ms", type=float, default=0.0,
                        help="fixed cost per KV transfer, with --transfer-gbps")
    parser.add_argument("--transport", default="auto", choices=["auto", "gloo", "grpc", "nccl", "ipc"],
                        help="the transport to measure (auto: gloo on CPU, nccl with 2 GPUs, ipc with one)")
    parser.add_argument("--calibrate", action="store_true",
                        help="serve a light load on a real colocated and disaggregated deployment first and fit the "
                             "serving path's CPU and fixed costs; kept in --save-profile (or the --load-profile "
                             "file)")
    parser.add_argument("--host-cores", type=float, default=None,
                        help="host cores the workers, KV transfers and serving processes share (default: this "
                             "machine's; 'inf': nothing shared)")
    parser.add_argument("--host-scheduler", choices=SCHEDULERS, default=SLICED,
                        help="how a step's waits for a core are spread when the cores are shared: 'sliced' (each "
                             "step's wait drawn around the fair share's mean, as a kernel's time slices spread "
                             "them) or 'fluid' (every step waits exactly its fair share)")
    parser.add_argument("--request-overhead-ms", type=float, default=None,
                        help="fixed time a request spends before its first token outside the engines (front end, "
                             "coordinator, Ray calls), added to every TTFT (default: calibrated, else 0)")
    parser.add_argument("--step-overhead-ms", type=float, default=None,
                        help="fixed time every worker step adds to the engine's (the worker's loop, its events) "
                             "(default: calibrated, else 0)")
    parser.add_argument("--profile-grid", choices=sorted(GRIDS), default="full",
                        help="quick: a few points (a rough profile in seconds)")
    parser.add_argument("--save-profile", default=None, metavar="FILE", help="write the measured steps here")
    parser.add_argument("--load-profile", default=None, metavar="FILE",
                        help="use steps measured before (--save-profile) instead of profiling")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="write the plan as JSON to FILE, or to stdout without FILE (the table then goes "
                             "to stderr)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine shapes of `tandem bench compare`'s modes (cluster/bench/compare_modes.py)."""
    parser.add_argument("--chunk-size", type=int, default=256, help="step token budget of a colocated replica")
    parser.add_argument("--long-prefill-threshold", type=int, default=256,
                        help="disaggregated workers: max tokens of one prompt per step (0: off)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="step token budget of a disaggregated worker")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-memory-mib", type=int, default=None,
                        help="KV pool of the profiled engines (CPU default 1024 MiB; GPU: the memory plan)")


def host_cores(args: argparse.Namespace) -> float:
    cores = float(os.cpu_count() or 1) if args.host_cores is None else args.host_cores
    if not cores > 0:
        raise ValueError(f"--host-cores must be > 0 (or inf), got {args.host_cores}")
    return cores


def hardware(args: argparse.Namespace) -> Hardware:
    """The budget and TP sizes with bench compare's defaults; ValueError names a bad count or TP size (a TP size
    must divide the budget: check_tp_sizes)."""
    import torch

    from cluster.bench.compare_modes import default_workers
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no GPU is visible here")
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    cores = os.cpu_count() or 1
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    devices = args.workers if args.workers is not None else (gpus or default_workers(0, cores))
    if devices < 1:
        raise ValueError(f"--gpus/--workers must be >= 1, got {devices}")
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise ValueError(f"--cpu-threads must be >= 1, got {args.cpu_threads}")
    unit = "GPUs" if device == "cuda" else "devices"
    check_tp_sizes(devices, args.prefill_tp, args.decode_tp, args.tp, unit)
    threads = args.cpu_threads or (1 if device == "cuda" else max(1, cores // devices))
    return Hardware(device, devices, threads, args.prefill_tp, args.decode_tp, args.tp)


def serving_flags(args: argparse.Namespace, device: str) -> tuple[EngineLimits, EngineLimits, EngineLimits]:
    """(prefill worker, decode worker, replica) limits, after checking every flag of the serving path;
    ValueError names the flag. Prefill first as `tandem serve` resolves its default on `device`."""
    if (args.request_overhead_ms or 0) < 0 or (args.step_overhead_ms or 0) < 0:
        raise ValueError("--request-overhead-ms and --step-overhead-ms must be >= 0")
    if args.transfer_gbps is not None and not args.transfer_gbps > 0 or args.transfer_latency_ms < 0:
        raise ValueError("--transfer-gbps must be > 0 and --transfer-latency-ms >= 0")
    if args.chunk_size < 1 or args.max_num_batched_tokens < 1 or args.max_num_seqs < 1:
        raise ValueError("--chunk-size, --max-num-batched-tokens and --max-num-seqs must be >= 1")
    if args.long_prefill_threshold < 0:
        raise ValueError(f"--long-prefill-threshold must be >= 0, got {args.long_prefill_threshold}")
    first = device == "cpu"
    worker = EngineLimits(args.max_num_batched_tokens, args.long_prefill_threshold, args.max_num_seqs, first)
    return worker, worker, EngineLimits(args.chunk_size, 0, args.max_num_seqs, first)




def add_tp_arguments(parser: argparse.ArgumentParser) -> None:
    """The TP size of each role (`tandem serve`'s flags) and what a TP group's collectives cost."""
    parser.add_argument("--prefill-tp", type=int, default=1, help="ranks (GPUs) of each prefill worker")
    parser.add_argument("--decode-tp", type=int, default=1, help="ranks (GPUs) of each decode worker")
    parser.add_argument("--tp", type=int, default=1, help="ranks (GPUs) of each colocated replica")
    parser.add_argument("--tp-cost", action="append", default=[], metavar="T:STEP_MS:TOKEN_US",
                        help="what TP=T's collectives add to a step: ms per step and us per token row (e.g. from "
                             "`tandem bench tp --tp T`; T:0:0 is the ideal); repeatable; default: measured here "
                             "(or kept in --load-profile)")


def given_tp_costs(args: argparse.Namespace) -> dict[int, TpCost]:
    """--tp-cost per TP size; ValueError on a bad one or a size given twice."""
    costs: dict[int, TpCost] = {}
    for text in args.tp_cost:
        cost = parse_tp_cost(text)
        if cost.tp in costs:
            raise ValueError(f"--tp-cost gives TP={cost.tp} twice")
        costs[cost.tp] = cost
    return costs
