"""Benchmark: KV-shaped payloads between two processes over a transport, next to a raw loopback socket.

`tandem bench transfer --transport gloo --sizes-mib 1,16,64,256 --json FILE` (or `python -m
kv_transfer.bench ...`; `--num-layers 1 --sizes-mib 0.0625,1,64` gives 64 KiB blocks, so a 64 KiB transfer
shows the fixed cost, and the line fitted over the sizes splits it from the per-byte rate). This process
receives; a spawned process sends. Per size and repeat it times one transfer (sender: send() -> ack, so
gather, checksums, wire, verify, scatter and ack are all in) and, interleaved, the baselines of
kv_transfer/bench_baselines.py: the same number of bytes over a plain TCP socket, and over gRPC also on a
bare grpc-python stream (the gRPC floor). Every transfer is checked byte for byte. With --compare-gathered, a
third interleaved measurement sends the same run gathered into staging (direct_min_plane_bytes=None, the path
before pool-to-pool planes) through a second sender/receiver pair.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from kv_transfer.bench_baselines import GrpcFloorClient, GrpcFloorSink, TcpSink, tcp_send
from kv_transfer.bench_results import fixed_and_per_byte, print_cost, print_row, write_results
from kv_transfer.config import DistRendezvous, ReceiverAddress, TransferConfig
from kv_transfer.factory import create_receiver, create_sender
from kv_transfer.host_copy import copy_tensor, host_array
from kv_transfer.manifest import ModelFingerprint
from kv_transfer.results import ReceivedKV, SendRequest
from kv_transfer.testing import FreeListPool


def bench_fingerprint(num_layers: int = 8) -> ModelFingerprint:
    """Llama-3-8B's KV block layout (8 KV heads x 128, bf16, 16 tokens: 64 KiB per layer per block) with
    num_layers layers: 512 KiB blocks and 1 MiB planes per 16 MiB run at 8; Llama-3-8B's own 32 layers
    give 2 MiB blocks and 256 KiB planes."""
    return ModelFingerprint(num_layers=num_layers, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16)



GATHERED = "gathered"  # the variant that gathers every run into staging
VARIANT_NAMESPACES = {"": "tandem-kv", GATHERED: "tandem-kv-gathered"}


@dataclass(frozen=True)
class SenderSpec:
    config: TransferConfig
    num_blocks: int
    device: str
    ranked: bool
    variants: tuple[str, ...] = ("",)
    num_layers: int = 8
    floor_port: int = 0  # the gRPC floor's sink (0: none)


@dataclass(frozen=True)
class SendCmd:
    to: ReceiverAddress
    num_blocks: int
    seed: int
    variant: str = ""


@dataclass(frozen=True)
class TcpCmd:
    port: int
    nbytes: int


@dataclass(frozen=True)
class FloorCmd:
    nbytes: int


@dataclass(frozen=True)
class Timed:
    seconds: float
    error: str = ""
    cpu_seconds: float = 0.0  # the sender process's CPU time (all threads) over the same interval


def fill_pattern(kv: torch.Tensor, num_blocks: int, seed: int) -> None:
    """Seeded random bytes in kv[:, :, :num_blocks] (the receiver regenerates them to compare). numpy on this thread:
    no torch intra-op team left spinning into the next timed transfer (its CPU would count as the transfer's)."""
    region = kv[:, :, :num_blocks]  # [L, 2, n, bs, H, D]
    noise = np.random.default_rng(seed).integers(0, 256, region.numel() * region.element_size(), dtype=np.uint8)
    copy_tensor(region, torch.from_numpy(noise).view(region.dtype).view(region.shape))


def _resident_pool(fp: ModelFingerprint, num_blocks: int, device: str) -> FreeListPool:
    """A pool whose pages are touched up front, like an engine's KV cache in steady state."""
    pool = FreeListPool(fp, num_blocks, device=device)
    pool.kv.view(torch.uint8).fill_(1)
    return pool


def _send_one(sender, pool: FreeListPool, cmd: SendCmd) -> Timed:
    blocks = tuple(range(cmd.num_blocks))
    pool.take(blocks)
    fill_pattern(pool.kv, cmd.num_blocks, cmd.seed)
    if pool.kv.is_cuda:
        torch.cuda.synchronize()
    started, cpu_started = time.perf_counter(), time.process_time()
    try:
        num_tokens = cmd.num_blocks * pool.kv.shape[3]  # [L, 2, N, block_size, H, D]
        sender.send(cmd.to, SendRequest(f"bench-{cmd.seed}", blocks, num_tokens, 0)).result()
    except Exception as exc:
        return Timed(time.perf_counter() - started, str(exc))
    return Timed(time.perf_counter() - started, cpu_seconds=time.process_time() - cpu_started)


def variant_config(config: TransferConfig, variant: str) -> TransferConfig:
    return replace(config, direct_min_plane_bytes=None) if variant == GATHERED else config


def variant_rendezvous(ranked: bool, rank: int, variant: str) -> DistRendezvous | None:
    return DistRendezvous(rank, 2, VARIANT_NAMESPACES[variant]) if ranked else None


def _sender_main(spec: SenderSpec, conn) -> None:
    fp = bench_fingerprint(spec.num_layers)
    pool = _resident_pool(fp, spec.num_blocks, spec.device)
    transport = spec.config.transport
    if transport == "ipc" and not pool.kv.is_cuda:
        pool.kv.share_memory_()  # the receiver maps this pool
    senders = {v: create_sender(variant_config(spec.config, v), pool.view(), transport,
                                variant_rendezvous(spec.ranked, 1, v)) for v in spec.variants}
    payload = memoryview(torch.randint(0, 256, (spec.num_blocks * fp.block_nbytes,), dtype=torch.uint8).numpy())
    floor = GrpcFloorClient(spec.floor_port, spec.config.grpc_max_message_bytes) if spec.floor_port else None
    while (cmd := conn.recv()) is not None:
        if isinstance(cmd, SendCmd):
            conn.send(_send_one(senders[cmd.variant], pool, cmd))
        elif isinstance(cmd, TcpCmd):
            conn.send(Timed(tcp_send(cmd.port, payload[: cmd.nbytes])))
        else:
            conn.send(Timed(floor.send(payload[: cmd.nbytes], spec.config.grpc_chunk_bytes)))
    for sender in senders.values():
        sender.close()
    if floor is not None:
        floor.close()


def _bit_exact(pool: FreeListPool, outcome, num_blocks: int, seed: int) -> bool:
    if not isinstance(outcome, ReceivedKV):
        return False
    expected = torch.empty((pool.kv.shape[0], 2, num_blocks) + tuple(pool.kv.shape[3:]), dtype=pool.kv.dtype)
    fill_pattern(expected, num_blocks, seed)
    ids = list(outcome.block_ids)
    got = host_array(pool.kv)[:, :, ids] if not pool.kv.is_cuda else host_array(pool.kv[:, :, ids].cpu())
    pool.free(outcome.block_ids)
    return bool(np.array_equal(got, host_array(expected)))


def _measure_size(args, receivers: dict, pool, sink, peer, num_blocks: int, seed0: int, floored: bool) -> dict:
    """Per repeat: one transfer per variant, then the raw socket (and the gRPC floor); medians per variant."""
    nbytes = num_blocks * bench_fingerprint(args.num_layers).block_nbytes
    times, cpus, base, floor, exact = {v: [] for v in receivers}, {v: [] for v in receivers}, [], [], True
    for rep in range(args.repeats):
        for variant, receiver in receivers.items():
            seed = seed0 + rep + (500 if variant else 0)
            cpu_started = time.process_time()  # this process idles while the sender fills its blocks
            peer.send(SendCmd(receiver.address, num_blocks, seed, variant))
            timed = peer.recv()
            outcome = receiver.wait(60)
            cpus[variant].append(time.process_time() - cpu_started + timed.cpu_seconds)
            exact &= not timed.error and _bit_exact(pool, outcome, num_blocks, seed)
            times[variant].append(timed.seconds)
        thread = sink.receive(nbytes)
        peer.send(TcpCmd(sink.port, nbytes))
        base.append(peer.recv().seconds)
        thread.join()
        if floored:
            peer.send(FloorCmd(nbytes))
            floor.append(peer.recv().seconds)
    seconds, baseline = statistics.median(times[""]), statistics.median(base)
    row = {"transport": args.transport, "num_layers": args.num_layers, "size_bytes": nbytes, "seconds": seconds,
           "gbps": nbytes / seconds / 1e9, "baseline_gbps": nbytes / baseline / 1e9,
           "cpu_seconds": statistics.median(cpus[""]), "bit_exact": bool(exact)}
    if floor:
        row["floor_gbps"] = nbytes / statistics.median(floor) / 1e9
    if GATHERED in times:
        row["gathered_gbps"] = nbytes / statistics.median(times[GATHERED]) / 1e9
        row["gathered_cpu_seconds"] = statistics.median(cpus[GATHERED])
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transport", choices=["gloo", "grpc", "nccl", "ipc"], default="gloo")
    parser.add_argument("--sizes-mib", default="1,16,64,256", help="comma-separated payload sizes in MiB")
    parser.add_argument("--repeats", type=int, default=5, help="transfers per size (the median is reported)")
    parser.add_argument("--json", default="", help='write {"rows": [...], "cost": the fitted costs or null} here')
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--max-run-mib", type=float, default=TransferConfig.max_run_bytes / 2**20,
                        help="split runs above this size (pipelines gather / wire / scatter)")
    parser.add_argument("--direct-min-plane-kib", type=float, default=TransferConfig.direct_min_plane_bytes / 2**10,
                        help="runs with planes this large leave the sender pool without a gather (-1: never)")
    parser.add_argument("--compare-gathered", action="store_true",
                        help="also time the same transfers with every run gathered into staging, interleaved")
    parser.add_argument("--num-layers", type=int, default=8,
                        help="layers of the Llama-3-8B-like block layout (32 = Llama-3-8B: 256 KiB planes)")
    parser.add_argument("--inline-max-mib", type=float, default=None,
                        help="gloo: transfers up to this size travel on the control connection, larger ones on a "
                             "process group (default: every transfer inline; 0: never)")
    parser.add_argument("--chunk-mib", type=float, default=TransferConfig.grpc_chunk_bytes / 2**20,
                        help="gRPC message size")


def _devices(transport: str) -> tuple[str, str] | None:
    """(sender device, receiver device): nccl needs two GPUs (None without); ipc uses the GPU when there is
    one (else CPU pools, the sender's in shared memory); the others use CPU pools."""
    if transport == "ipc":
        return ("cuda:0", "cuda:0") if torch.cuda.is_available() else ("cpu", "cpu")
    if transport != "nccl":
        return "cpu", "cpu"
    return ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else None


def _transfer_config(args: argparse.Namespace) -> TransferConfig:
    direct_min = None if args.direct_min_plane_kib < 0 else int(args.direct_min_plane_kib * 2**10)
    inline_max = None if args.inline_max_mib is None else int(args.inline_max_mib * 2**20)
    return TransferConfig(transport=args.transport, kv_transfer_timeout_s=args.timeout_s,
                          max_run_bytes=int(args.max_run_mib * 2**20), grpc_chunk_bytes=int(args.chunk_mib * 2**20),
                          direct_min_plane_bytes=direct_min, inline_max_bytes=inline_max)


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark; 0 if every transfer was bit-exact, 1 otherwise, 2 for an unusable setup."""
    devices = _devices(args.transport)
    if devices is None:
        print(f"bench transfer: '{args.transport}' is unavailable here (nccl needs 2 GPUs)")
        return 2
    sender_device, receiver_device = devices
    sizes = [float(s) for s in args.sizes_mib.split(",") if s]
    fp = bench_fingerprint(args.num_layers)
    blocks = [max(1, int(mib * 2**20) // fp.block_nbytes) for mib in sizes]
    pool = _resident_pool(fp, max(blocks), receiver_device)
    config = _transfer_config(args)
    ranked = args.transport != "grpc"
    variants = ("", GATHERED) if args.compare_gathered else ("",)
    receivers = {v: create_receiver(variant_config(config, v), pool.view(), args.transport,
                                    rendezvous=variant_rendezvous(ranked, 0, v), peers=[1]) for v in variants}
    sink = TcpSink(max(blocks) * fp.block_nbytes)
    floor_sink = GrpcFloorSink(max(blocks) * fp.block_nbytes, config.grpc_max_message_bytes) if not ranked else None
    ctx = mp.get_context("spawn")
    peer, child = ctx.Pipe()
    spec = SenderSpec(config, max(blocks), sender_device, ranked, variants, args.num_layers,
                      floor_port=floor_sink.port if floor_sink else 0)
    process = ctx.Process(target=_sender_main, args=(spec, child), daemon=True)
    process.start()
    rows = []
    try:
        for i, num_blocks in enumerate(blocks):
            floored = floor_sink is not None
            rows.append(_measure_size(args, receivers, pool, sink, peer, num_blocks, 1000 * i, floored))
            print_row(rows[-1])
    finally:
        for receiver in receivers.values():  # first: an ipc receiver lets go of the sender's pool before it exits
            receiver.close()
        peer.send(None)
        process.join(60)
        if process.is_alive():
            process.kill()
        sink.close()
        if floor_sink is not None:
            floor_sink.close()
    cost = fixed_and_per_byte(rows)
    if cost is not None:
        print_cost(args.transport, args.num_layers, cost)
    if args.json:
        write_results(Path(args.json), rows, cost)
    return 0 if all(row["bit_exact"] for row in rows) else 1


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
