"""`tandem plan`: which P:D split (or colocated replicas) to run on G devices for a workload and SLOs.

    tandem plan --gpus 2 --request-rate 4 --dataset-name mixed --mixed-long-fraction 0.2 \
        --mixed-long-len 1536 --mixed-short-len 64 --num-prompts 48 --ttft-slo-ms 250 --itl-slo-ms 12
    tandem plan --gpus 8 --prefill-tp 2 --decode-tp 1 --tp 2 ...   # tensor-parallel workers

1. profiles one prefill worker's and one decode worker's engine for real at TP=1 (cluster/plan/profile.py), with
   the thread share a CPU device gets (cores / devices, as `tandem bench compare` gives them) or one GPU;
2. measures the KV transfer (`tandem bench transfer`) unless --transfer-gbps gives it;
3. for every TP size > 1 (--prefill-tp, --decode-tp, --tp), takes what its collectives add to a step from
   --tp-cost or a loaded profile, else measures it on a TP engine (cluster/plan/tp_model.py);
4. with --calibrate, serves a light load on a real colocated and disaggregated deployment and fits the serving
   path's costs (cluster/plan/calibrate.py; kept in the profile JSON), else takes them from a loaded profile;
5. simulates every deployment of the G devices (colocated-(G/T), then each split P x A + D x B <= G: see
   cluster/plan/deployment.py) on the same requests, on --host-cores cores shared by the workers, the KV
   transfers and the serving path (cluster/plan/simulator.py, host_model.py) and scores each as `tandem bench
   serve` scores a run;
6. prints the table (GPUs per role) and the recommendation (cluster/plan/predict.py); --json for machines.

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
from cluster.plan.flags import Hardware, add_arguments, given_tp_costs, hardware, host_cores, serving_flags
from cluster.plan.host_model import HostModel, ServingCosts
from cluster.plan.predict import Slos, predict, recommend
from cluster.plan.profile import GRIDS, EngineProfile, WorkerEngines, profile_workers
from cluster.plan.report import format_profile, format_serving, format_table, format_tp, plan_json, sample_curves
from cluster.plan.simulator import ServingShape
from cluster.plan.tp_model import TpCost, measure_tp_cost
from cluster.plan.transfer_model import TransferModel, given_transfer, measured_transfer
from cluster.plan.workload import workload_from_flags

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    """Plans; 0 with a recommendation, 2 when no deployment meets the SLOs. ValueError (exit 2) on bad flags,
    before anything is profiled."""
    slos = Slos(args.ttft_slo_ms, args.itl_slo_ms, args.slo_attainment)
    hw = hardware(args)
    deployments = deployments_for(hw.devices, hw.prefill_tp, hw.decode_tp, hw.replica_tp)
    workload = workload_from_flags(args)
    limits, given = serving_flags(args, hw.device), given_tp_costs(args)
    host = HostModel(host_cores(args), hw.threads if hw.device == "cpu" else 1, scheduler=args.host_scheduler,
                     wait_seed=args.seed)
    profile = _profile(args, hw.device, hw.threads)
    longest = max(r.prompt_len + r.output_len for r in workload.requests)
    if longest > profile.max_model_len:
        raise ValueError(f"the workload has a request of {longest} tokens; the engine holds {profile.max_model_len}")
    model = profile.fit()
    profile = _tp_costs(args, hw, profile, model, given)
    transfer = _transfer(args, profile, hw.device) if any(d.is_disaggregated for d in deployments) else \
        TransferModel(profile.bytes_per_block, profile.block_size, 1e9, 0.0, "none (no split to move KV in)")
    base = ServingShape(*limits, transfer, host=host, tp_costs=profile.tp_costs)
    if args.calibrate:
        profile = _calibrate(args, profile, model, base, hw)
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
    print(format_tp(hw.devices, hw.unit, profile.tp_costs, hw.tp_sizes), file=out)
    print(format_table(predictions, recommendation, slos, hw.unit), file=out)
    if args.json is not None:
        context = {"model": profile.model, "device": profile.device, "workers": hw.devices, "devices": hw.devices,
                   "cpu_threads": hw.threads, "prefill_tp": hw.prefill_tp, "decode_tp": hw.decode_tp,
                   "replica_tp": hw.replica_tp, "tp_costs": [c.as_dict() for c in profile.tp_costs],
                   "workload": {"description": workload.description, "request_rate": _rate(workload.request_rate),
                                "num_requests": len(workload.requests)},
                   **_model_context(profile, model, transfer, shapes)}
        _write_json(plan_json(predictions, recommendation, slos, context), args.json)
    return 0 if recommendation.meets_slos else 2


def _tp_costs(args: argparse.Namespace, hw: Hardware, profile: EngineProfile, model,
              given: dict[int, TpCost]) -> EngineProfile:
    """The profile with a TpCost for every TP size the deployments use: --tp-cost's, else the loaded profile's,
    else measured here (then kept in --save-profile's file). ValueError when one cannot be measured."""
    loaded = {cost.tp: cost for cost in profile.tp_costs}
    costs, measured = [], False
    for tp in hw.tp_sizes:
        cost = given.get(tp) or loaded.get(tp)
        if cost is None:
            try:
                cost = measure_tp_cost(tp, model, args.model, args.dtype, hw.device, hw.threads)
            except RuntimeError as error:
                raise ValueError(str(error)) from None
            measured = True
        costs.append(cost)
    profile = replace(profile, tp_costs=tuple(costs) + tuple(c for c in profile.tp_costs if c.tp not in hw.tp_sizes))
    if measured and args.save_profile is not None:
        Path(args.save_profile).write_text(json.dumps(profile.as_dict(), indent=1))
    return profile


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


def _calibrate(args: argparse.Namespace, profile: EngineProfile, model, base: ServingShape,
               hw: Hardware) -> EngineProfile:
    """The profile with freshly calibrated serving costs (on deployments of the plan's TP sizes), written to
    --save-profile or --load-profile's file."""
    from cluster.bench.compare_modes import ModeSettings
    from cluster.plan.calibrate import calibrate, calibration_deployments
    device = hw.device
    settings = ModeSettings(args.model, args.dtype, device, "auto", 256, args.chunk_size, args.kv_cache_memory_mib,
                            args.long_prefill_threshold, num_gpus=_num_gpus(device))
    deployments = calibration_deployments(hw.devices, hw.prefill_tp, hw.decode_tp, hw.replica_tp)
    try:
        here = replace(base, host=replace(base.host, cores=float(os.cpu_count() or 1)))  # measured on this host
        serving = {_kind(d): calibrate(d, settings, model, here) for d in deployments}
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
