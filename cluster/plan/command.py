"""`tandem plan`: which P:D split (or colocated replicas) to run on W workers for a workload and SLOs.

    tandem plan --workers 2 --request-rate 4 --dataset-name mixed --mixed-long-fraction 0.2 \
        --mixed-long-len 1536 --mixed-short-len 64 --num-prompts 48 --ttft-slo-ms 250 --itl-slo-ms 12

1. profiles one prefill worker's and one decode worker's engine for real (cluster/plan/profile.py), with the
   thread share a CPU worker gets (cores / workers, as `tandem bench compare` gives them) or one GPU;
2. measures the KV transfer (`tandem bench transfer`) unless --transfer-gbps gives it;
3. with --calibrate, serves a light load on a real colocated and disaggregated deployment and fits the serving
   path's costs (cluster/plan/calibrate.py; kept in the profile JSON), else takes them from a loaded profile;
4. simulates every deployment of the workers (colocated-W, disagg-1p(W-1)d ... (W-1)p1d) on the same
   requests, on --host-cores cores shared by the workers, the KV transfers and the serving path
   (cluster/plan/simulator.py, host_model.py) and scores each as `tandem bench serve` scores a run;
5. prints the table and the recommendation (cluster/plan/predict.py); --json for machines.

Exit status: 0 with a recommendation; 2 when no deployment meets the SLOs (the table and the closest are
still printed, and the JSON written), and for bad flags or a workload file that is not a bench result.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

from cluster.plan.deployment import Deployment, deployments_for
from cluster.plan.engine_sim import EngineLimits
from cluster.plan.host_model import SCHEDULERS, SLICED, HostModel, ServingCosts
from cluster.plan.predict import Slos, predict, recommend
from cluster.plan.profile import GRIDS, EngineProfile, WorkerEngines, profile_workers
from cluster.plan.report import format_profile, format_serving, format_table, plan_json, sample_curves
from cluster.plan.simulator import ServingShape
from cluster.plan.transfer_model import TransferModel, given_transfer, measured_transfer
from cluster.plan.workload import add_workload_arguments, workload_from_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded model)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--workers", "--devices", type=int, default=None, dest="workers",
                        help="workers to split: GPUs (one per worker), or CPU workers of --cpu-threads each "
                             "(default: the GPUs, else 4 with 8 cores or 2, as `tandem bench compare`)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch threads per CPU worker (default: cores / workers, at least 1)")
    parser.add_argument("--ttft-slo-ms", type=float, required=True, help="time to first token target")
    parser.add_argument("--itl-slo-ms", type=float, required=True,
                        help="inter-token latency target, held against each request's mean (vLLM's TPOT)")
    parser.add_argument("--slo-attainment", type=float, default=0.9,
                        help="share of requests that must meet both SLOs for a deployment to meet them")
    add_workload_arguments(parser)
    _add_engine_arguments(parser)
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


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine shapes of `tandem bench compare`'s modes (cluster/bench/compare_modes.py)."""
    parser.add_argument("--chunk-size", type=int, default=256, help="step token budget of a colocated replica")
    parser.add_argument("--long-prefill-threshold", type=int, default=256,
                        help="disaggregated workers: max tokens of one prompt per step (0: off)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="step token budget of a disaggregated worker")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-memory-mib", type=int, default=None,
                        help="KV pool of the profiled engines (CPU default 1024 MiB; GPU: the memory plan)")


def run(args: argparse.Namespace) -> int:
    """Plans; 0 with a recommendation, 2 when no deployment meets the SLOs. ValueError (exit 2) on bad flags,
    before anything is profiled."""
    slos = Slos(args.ttft_slo_ms, args.itl_slo_ms, args.slo_attainment)
    device, workers, threads = _hardware(args)
    deployments = deployments_for(workers)
    workload = workload_from_flags(args)
    limits = _serving_flags(args, device)
    host = HostModel(_host_cores(args), threads if device == "cpu" else 1, scheduler=args.host_scheduler,
                     wait_seed=args.seed)
    profile = _profile(args, device, threads)
    longest = max(r.prompt_len + r.output_len for r in workload.requests)
    if longest > profile.max_model_len:
        raise ValueError(f"the workload has a request of {longest} tokens; the engine holds {profile.max_model_len}")
    model = profile.fit()
    transfer = _transfer(args, profile, device) if workers > 1 else TransferModel(
        profile.bytes_per_block, profile.block_size, 1e9, 0.0, "none (one worker: no split to move KV in)")
    base = ServingShape(*limits, transfer, host=host)
    if args.calibrate:
        profile = _calibrate(args, profile, model, base, device, workers)
    shapes = {kind: _shape(args, base, profile.serving.get(kind)) for kind in ("colocated", "disaggregated")}
    predictions = [predict(d, list(workload.requests), model, shapes[_kind(d)], slos) for d in deployments]
    recommendation = recommend(predictions, slos)
    out = sys.stderr if args.json == "-" else sys.stdout
    print(format_profile(profile, model), file=out)
    print(f"workload: {len(workload.requests)} requests at {workload.request_rate:g} req/s, {workload.description}",
          file=out)
    print(f"KV transfer: {transfer.source}; {transfer.bytes_per_block} bytes per {transfer.block_size}-token block",
          file=out)
    print(format_serving(shapes, profile.serving), file=out)
    print(format_table(predictions, recommendation, slos), file=out)
    if args.json is not None:
        context = {"model": profile.model, "device": profile.device, "workers": workers, "cpu_threads": threads,
                   "workload": {"description": workload.description, "request_rate": _rate(workload.request_rate),
                                "num_requests": len(workload.requests)},
                   **_model_context(profile, model, transfer, shapes)}
        _write_json(plan_json(predictions, recommendation, slos, context), args.json)
    return 0 if recommendation.meets_slos else 2


def _model_context(profile: EngineProfile, model, transfer: TransferModel, shapes: dict) -> dict:
    """The JSON's words for what the prediction rests on: the fitted steps, the transfer, the host."""
    host = next(iter(shapes.values())).host
    return {"profile": {"steps": len(profile.steps), "coefficients": model.as_dict(), **sample_curves(model)},
            "transfer": {"source": transfer.source, "bytes_per_second": transfer.bytes_per_second,
                         "latency_s": transfer.latency_s, "bytes_per_block": transfer.bytes_per_block},
            "host_cores": _rate(host.cores), "host_scheduler": host.scheduler,
            "serving": {kind: {**shape.costs.as_dict(), "calibrated": kind in profile.serving}
                        for kind, shape in shapes.items()}}


def _kind(deployment: Deployment) -> str:
    return "disaggregated" if deployment.is_disaggregated else "colocated"


def _shape(args: argparse.Namespace, base: ServingShape, calibrated: ServingCosts | None) -> ServingShape:
    """`base` with the calibrated costs of its kind (none: engine-bound), the overhead flags over them."""
    costs = calibrated or ServingCosts()
    if args.request_overhead_ms is not None:
        costs = replace(costs, request_overhead_s=args.request_overhead_ms / 1e3)
    if args.step_overhead_ms is not None:
        costs = replace(costs, step_overhead_s=args.step_overhead_ms / 1e3)
    return replace(base, costs=costs)


def _calibrate(args: argparse.Namespace, profile: EngineProfile, model, base: ServingShape, device: str,
               workers: int) -> EngineProfile:
    """The profile with freshly calibrated serving costs, written to --save-profile or --load-profile's file."""
    from cluster.bench.compare_modes import ModeSettings
    from cluster.plan.calibrate import calibrate, calibration_deployments
    settings = ModeSettings(args.model, args.dtype, device, "auto", 256, args.chunk_size, args.kv_cache_memory_mib,
                            args.long_prefill_threshold, num_gpus=_num_gpus(device))
    try:
        here = replace(base, host=replace(base.host, cores=float(os.cpu_count() or 1)))  # measured on this host
        serving = {_kind(d): calibrate(d, settings, model, here) for d in calibration_deployments(workers)}
    except (RuntimeError, OSError) as error:
        raise ValueError(f"--calibrate: {error}") from None
    profile = replace(profile, serving=serving)
    destination = args.save_profile or args.load_profile
    if destination is not None:
        Path(destination).write_text(json.dumps(profile.as_dict(), indent=1))
        print(f"tandem plan: calibrated serving costs saved in {destination}", file=sys.stderr)
    return profile


def _num_gpus(device: str) -> int:
    import torch
    return torch.cuda.device_count() if device == "cuda" else 0


def _host_cores(args: argparse.Namespace) -> float:
    cores = float(os.cpu_count() or 1) if args.host_cores is None else args.host_cores
    if not cores > 0:
        raise ValueError(f"--host-cores must be > 0 (or inf), got {args.host_cores}")
    return cores


def _hardware(args: argparse.Namespace) -> tuple[str, int, int]:
    """(device, workers, torch threads per worker) with bench compare's defaults; ValueError on bad counts."""
    import torch

    from cluster.bench.compare_modes import default_workers
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no GPU is visible here")
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    cores = os.cpu_count() or 1
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    workers = args.workers if args.workers is not None else (gpus or default_workers(0, cores))
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise ValueError(f"--cpu-threads must be >= 1, got {args.cpu_threads}")
    threads = args.cpu_threads or (1 if device == "cuda" else max(1, cores // workers))
    return device, workers, threads


def _serving_flags(args: argparse.Namespace, device: str) -> tuple[EngineLimits, EngineLimits, EngineLimits]:
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


def _profile(args: argparse.Namespace, device: str, threads: int) -> EngineProfile:
    if args.load_profile is not None:
        try:
            profile = EngineProfile.from_dict(json.loads(Path(args.load_profile).read_text()))
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"--load-profile {args.load_profile}: {error}") from None
        if (profile.device.split(":")[0], profile.cpu_threads) != (device, threads):
            print(f"tandem plan: note: the loaded profile was measured on {profile.device} with "
                  f"{profile.cpu_threads} thread(s), not {device} with {threads}", file=sys.stderr)
        return profile
    from engine.config import EngineConfig
    memory = None if args.kv_cache_memory_mib is None else args.kv_cache_memory_mib << 20
    config = EngineConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                          long_prefill_token_threshold=args.long_prefill_threshold, kv_cache_memory=memory,
                          prefill_first="off")  # the profile times mixed steps; the simulation schedules
    profile = profile_workers(WorkerEngines(args.model, args.dtype, device, threads, config, config),
                              GRIDS[args.profile_grid])
    if args.save_profile is not None:
        Path(args.save_profile).write_text(json.dumps(profile.as_dict(), indent=1))
    return profile


def _transfer(args: argparse.Namespace, profile: EngineProfile, device: str):
    if args.transfer_gbps is not None:
        return given_transfer(profile.bytes_per_block, profile.block_size, args.transfer_gbps,
                              args.transfer_latency_ms)
    transport = args.transport
    if transport == "auto":
        import torch
        transport = "gloo" if device == "cpu" else ("nccl" if torch.cuda.device_count() >= 2 else "ipc")
    try:
        return measured_transfer(profile.bytes_per_block, profile.block_size, transport)
    except RuntimeError as error:
        raise ValueError(str(error)) from None


def _rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _write_json(data: dict, destination: str) -> None:
    text = json.dumps(data, indent=2)
    if destination == "-":
        print(text)
    else:
        Path(destination).write_text(text + "\n")
