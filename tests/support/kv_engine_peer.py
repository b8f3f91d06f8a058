"""A prefill engine in a spawned process, driven by typed commands over a multiprocessing pipe.

The pytest process hosts the decode engine and the receivers; this peer runs a real LLMEngine with
prefill_only requests and ships their KV blocks with the real KVSender through kv_transfer.engine_pool.
It also reports a digest of each request's prompt KV, taken before the transfer, so the test can check
that the decode side's blocks hold the same bits.
"""
from __future__ import annotations

import hashlib
import os
import traceback
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kv_transfer import DistRendezvous, KVTransferError, ReceiverAddress, TransferConfig, create_sender
from kv_transfer.engine_pool import engine_pool_view, ship_prefilled
from tests.support.child_processes import child_context


@dataclass(frozen=True)
class PrefillPeerSpec:
    """The prefill engine (checkpoint, block size, pool size) and how its senders reach receivers."""

    model: str
    block_size: int
    num_kv_blocks: int
    rank: int = 1
    world_size: int = 2
    max_run_bytes: int = 16 << 10  # small runs: a long prompt travels as several pipelined runs
    direct_min_plane_bytes: int | None = 0  # every run goes pool to pool as planes (the gathered path
                                            # is what tests/support/kv_peer.py's tiny pools exercise)
    timeout_s: float = 20.0


@dataclass(frozen=True)
class Prefill:
    """Prefill these prompts (request id -> token ids) together; keep their KV for Ship."""

    prompts: tuple[tuple[str, tuple[int, ...]], ...]
    max_tokens: int


@dataclass(frozen=True)
class Prefilled:
    request_id: str
    first_token: int
    block_ids: tuple[int, ...]
    kv_digest: str
    num_cached_tokens: int


@dataclass(frozen=True)
class Ship:
    """Send the KV of these prefilled requests to `to`, all at once (the peer does not wait)."""

    request_ids: tuple[str, ...]
    to: ReceiverAddress
    namespace: str = "engines"


@dataclass(frozen=True)
class AwaitShipped:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class PoolState:
    pass


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Reply:
    ok: bool
    value: object = None
    error: str = ""
    extra: dict = field(default_factory=dict)


def prompt_kv_digest(kv: torch.Tensor, block_ids: Sequence[int], num_tokens: int) -> str:
    """sha256 of the K/V of the first num_tokens slots of block_ids, all layers (the prompt's KV)."""
    blocks = kv[:, :, list(block_ids)]  # [L, 2, n, bs, H, D]
    num_layers, two, n, block_size, heads, head_dim = blocks.shape
    slots = blocks.reshape(num_layers, two, n * block_size, heads, head_dim)[:, :, :num_tokens]  # [L, 2, T, H, D]
    return hashlib.sha256(slots.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


class _PrefillPeer:
    def __init__(self, spec: PrefillPeerSpec):
        from tests.support.engines import make_llm  # imported here: the parent only needs the command types
        self.spec = spec
        self.engine = make_llm(spec.model, block_size=spec.block_size, num_kv_blocks=spec.num_kv_blocks).engine
        self.config = TransferConfig(kv_transfer_timeout_s=spec.timeout_s, connect_timeout_s=30,
                                     max_run_bytes=spec.max_run_bytes,
                                     direct_min_plane_bytes=spec.direct_min_plane_bytes)
        self.senders: dict[tuple[str, str], object] = {}
        self.handles: dict[str, object] = {}

    def sender(self, transport: str, namespace: str):
        if (transport, namespace) not in self.senders:
            spec, rdzv = self.spec, None
            if transport != "grpc":
                rdzv = DistRendezvous(spec.rank, spec.world_size, namespace)
            view = engine_pool_view(self.engine)
            self.senders[(transport, namespace)] = create_sender(self.config, view, transport, rdzv)
        return self.senders[(transport, namespace)]

    def prefill(self, cmd: Prefill) -> list[Prefilled]:
        from engine import SamplingParams
        params = SamplingParams(max_tokens=cmd.max_tokens, temperature=0.0, ignore_eos=True)
        for request_id, prompt in cmd.prompts:
            self.engine.add_request(request_id, list(prompt), params, prefill_only=True)
        last = {}
        while len(last) < len(cmd.prompts):
            last.update({d.request_id: d for d in self.engine.step() if d.finished})
        prompts = dict(cmd.prompts)
        return [self._describe(last[rid], len(prompts[rid])) for rid, _ in cmd.prompts]

    def _describe(self, delta, num_tokens: int) -> Prefilled:
        assert delta.kv_block_ids is not None, f"prefill of {delta.request_id} kept no KV: {delta}"
        digest = prompt_kv_digest(self.engine.kv_cache.kv, delta.kv_block_ids, num_tokens)
        return Prefilled(delta.request_id, delta.new_token_ids[0], delta.kv_block_ids, digest,
                         delta.metrics.num_cached_tokens)

    def ship(self, cmd: Ship) -> None:
        sender = self.sender(cmd.to.transport, cmd.namespace)
        for request_id in cmd.request_ids:
            self.handles[request_id] = ship_prefilled(self.engine, sender, cmd.to, request_id)

    def await_shipped(self, cmd: AwaitShipped) -> dict[str, str]:
        statuses = {}
        for request_id in cmd.request_ids:
            try:
                self.handles.pop(request_id).result(timeout=60)
                statuses[request_id] = "OK"
            except KVTransferError as exc:
                statuses[request_id] = f"{exc.status.name}: {exc.message}"
        return statuses

    def pool_state(self) -> dict:
        engine = self.engine
        return {"free": engine.num_free_blocks, "total": engine.num_total_blocks, "live": engine.num_live_requests}

    def handle(self, cmd) -> Reply:
        if isinstance(cmd, Prefill):
            return Reply(True, self.prefill(cmd))
        if isinstance(cmd, Ship):
            self.ship(cmd)
            return Reply(True)
        if isinstance(cmd, AwaitShipped):
            return Reply(True, self.await_shipped(cmd))
        if isinstance(cmd, PoolState):
            return Reply(True, self.pool_state())
        raise TypeError(f"unknown command {cmd!r}")

    def serve(self, conn) -> None:
        while not isinstance(cmd := conn.recv(), Stop):
            try:
                reply = self.handle(cmd)
            except Exception:  # report harness and engine errors instead of leaving the test waiting
                reply = Reply(False, error=traceback.format_exc())
            conn.send(reply)
        for sender in self.senders.values():
            sender.close()


def _peer_main(spec: PrefillPeerSpec, conn) -> None:
    _PrefillPeer(spec).serve(conn)


class PrefillPeerProcess:
    """Starts the prefill peer (a child_context process); call() sends a command and returns the value of its Reply."""

    def __init__(self, spec: PrefillPeerSpec):
        ctx = child_context()
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_peer_main, args=(spec, child), daemon=True)
        self.process.start()

    def post(self, cmd) -> None:
        """Sends a command without waiting; collect its answer with reply()."""
        self.conn.send(cmd)

    def reply(self, timeout: float = 60):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"prefill peer did not answer within {timeout}s")
        reply = self.conn.recv()
        if not reply.ok:
            raise AssertionError(f"prefill peer failed:\n{reply.error}")
        return reply.value

    def call(self, cmd, timeout: float = 60):
        self.post(cmd)
        return self.reply(timeout)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(Stop())
            except OSError:
                pass
            self.process.join(30)
        if self.process.is_alive():
            os.kill(self.process.pid, 9)
            self.process.join(10)
