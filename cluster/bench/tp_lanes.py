"""Benchmark: a KV hand-off between two tensor-parallel groups by lanes against the same hand-off through rank 0.

`tandem bench tp-lanes --shape llama-25m --tp 2 --transport gloo --prefill-tokens 1024 --rounds 8`: a prefill group
and a decode group of --tp ranks each (or --prefill-tp / --decode-tp: groups of two sizes, one of them may be a single
rank) live at once (rank 0 of each in this process, the followers in their own), joined both ways a worker joins them:
the transport's sender and receiver through each group's full-head staging pool on rank 0 (kv_transfer/group_pool.py:
gathered there, sent once, scattered from there), and KV lanes (kv_transfer/lanes/: each rank's heads from its
prefill rank straight to the decode ranks that hold them, split or merged between sizes). Each round prefills two
fresh prompts of --prefill-tokens and hands one over each way, alternating which goes first; a hand-off is timed
from the ship to the KV in the decode engine's blocks on every rank (the staged one scattered). Medians; the ratio
lanes / rank 0. On a CPU the ranks share the cores, so both ways move the same bytes through the same memory; what
lanes save there is rank 0's gather and scatter. With NCCL on GPUs they also use every rank's link at once (a
multi-GPU number: docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import tempfile
import time
from pathlib import Path

WAYS = ("rank 0", "lanes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="llama-25m", help="seeded random checkpoint (cluster/bench/checkpoint.py)")
    parser.add_argument("--model", default=None, help="a checkpoint directory or GGUF file instead of --shape")
    parser.add_argument("--tp", type=int, default=2, help="ranks of each group")
    parser.add_argument("--prefill-tp", type=int, default=None, help="ranks of the prefill group (default --tp)")
    parser.add_argument("--decode-tp", type=int, default=None, help="ranks of the decode group (default --tp)")
    parser.add_argument("--transport", default="gloo", choices=("gloo", "grpc"), help="the KV transport")
    parser.add_argument("--prefill-tokens", type=int, default=1024, help="tokens of each handed-over prompt")
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds (medians are reported)")


class GroupPair:
    """A prefill group of args.prefill_tp ranks and a decode group of args.decode_tp, joined through rank 0 and by
    lanes."""

    def __init__(self, model: str, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
        from engine.builder import build_engine
        from engine.config import EngineConfig
        from kv_transfer import DistRendezvous, TransferConfig, create_receiver, create_sender
        from kv_transfer.engine_pool import receiver_pool, sender_pool
        from kv_transfer.lanes import GroupLanes, LaneReceiver, LaneSender

        config = TransferConfig(transport=args.transport, kv_transfer_timeout_s=60)
        ranked = args.transport != "grpc"
        send_rdzv, receive_rdzv = (DistRendezvous(0, 2, "bench-lanes"), DistRendezvous(1, 2, "bench-lanes")) \
            if ranked else (None, None)
        engines = []
        for role, tp, rendezvous, peers in (("send", args.prefill_tp, send_rdzv, ()),
                                            ("receive", args.decode_tp, receive_rdzv, (0,))):
            engine_config = EngineConfig(tensor_parallel_size=tp, kv_cache_memory=256 << 20,
                                         max_num_batched_tokens=max(2048, args.prefill_tokens))
            lanes = GroupLanes.open(role, args.transport, config, rendezvous, peers)
            engine = build_engine(model, engine_config, "float32", "cpu",
                                  tp_rank_service=lanes.spec if tp > 1 else None)
            stack.callback(engine.close)
            engines.append((engine, lanes))
        (self.prefill, send_lanes), (self.decode, receive_lanes) = engines
        pool, self.send_staging = sender_pool(self.prefill)
        self.staged_sender = stack.enter_context(contextlib.closing(create_sender(config, pool, args.transport,
                                                                                  send_rdzv)))
        pool, self.receive_staging = receiver_pool(self.decode)
        self.staged_receiver = stack.enter_context(contextlib.closing(create_receiver(
            config, pool, args.transport, receive_rdzv, (0,))))
        self.lane_sender = stack.enter_context(contextlib.closing(LaneSender(self.prefill, send_lanes.hub,
                                                                             send_lanes.spec)))
        self.lane_receiver = stack.enter_context(contextlib.closing(LaneReceiver(self.decode, receive_lanes.hub,
                                                                                 receive_lanes.spec)))

    def hand_over(self, way: str, prompt: list[int]) -> tuple[float, int]:
        """Prefill prompt, then ms from the ship to its KV in the decode engine's blocks on every rank, and bytes."""
        from engine import SamplingParams
        from kv_transfer import ReceivedKV
        from kv_transfer.engine_pool import land_delivered, ship_prefilled

        request_id = f"{way}-{random.random()}"
        self.prefill.add_request(request_id, prompt, SamplingParams(max_tokens=2), prefill_only=True)
        while not any(d.kv_block_ids is not None for d in self.prefill.step()):
            pass
        lanes = way == "lanes"
        sender, receiver = (self.lane_sender, self.lane_receiver) if lanes else \
            (self.staged_sender, self.staged_receiver)
        address = receiver.address
        start = time.perf_counter()
        handle = ship_prefilled(self.prefill, sender, address, request_id,
                                staging=None if lanes else self.send_staging)
        outcome = receiver.wait(60)
        if not isinstance(outcome, ReceivedKV):
            raise RuntimeError(f"the {way} hand-off failed: {outcome}")
        landed = land_delivered(outcome, None if lanes else self.receive_staging)
        elapsed = (time.perf_counter() - start) * 1e3
        nbytes = handle.result(60).kv_bytes
        self.decode.free_blocks(list(landed.block_ids))
        return elapsed, nbytes


def run(args: argparse.Namespace) -> int:
    from cluster.bench.checkpoint import build_bench_checkpoint

    args.prefill_tp, args.decode_tp = args.prefill_tp or args.tp, args.decode_tp or args.tp
    if min(args.prefill_tp, args.decode_tp) < 1 or max(args.prefill_tp, args.decode_tp) < 2 or args.rounds < 1 \
            or args.prefill_tokens < 1:
        raise ValueError("one group needs >= 2 ranks (--tp, --prefill-tp, --decode-tp), the other >= 1; --rounds >= 1, "
                         "--prefill-tokens >= 1")
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    nbytes = 0
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        model = args.model or str(build_bench_checkpoint(Path(scratch) / args.shape, args.shape))
        pair = GroupPair(model, args, stack)
        vocab = pair.prefill.model_config.vocab_size
        rng = random.Random(0)
        for round_index in range(args.rounds + 1):  # round 0 warms both ways up
            for way in WAYS if round_index % 2 else WAYS[::-1]:
                prompt = [rng.randrange(vocab) for _ in range(args.prefill_tokens)]
                elapsed, nbytes = pair.hand_over(way, prompt)
                if round_index:
                    times[way].append(elapsed)
    report(times, nbytes, args)
    return 0


def report(times: dict[str, list[float]], nbytes: int, args: argparse.Namespace) -> None:
    medians = {way: statistics.median(values) for way, values in times.items()}
    print(f"{args.model or args.shape}, TP={args.prefill_tp} -> TP={args.decode_tp} over {args.transport}, "
          f"{args.prefill_tokens}-token prompts ({nbytes / (1 << 20):.1f} MiB of KV), "
          f"median of {args.rounds} alternating rounds")
    for way in WAYS:
        spread = f"{min(times[way]):.1f}-{max(times[way]):.1f}"
        print(f"  {'through rank 0' if way == 'rank 0' else 'by lanes':<16} {medians[way]:8.1f} ms   ({spread})")
    print(f"  lanes / rank 0: {medians['lanes'] / medians['rank 0']:.2f}x")
