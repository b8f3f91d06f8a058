"""WorkerTemplate: how to build any worker of a started cluster, at start or added while serving (frozen).

    template = worker_template(config, spec, transport)
    actor_class, args = template.actor_args("decode", "decode-3", rank=7, peer_ranks=(0, 1))
    bundle = template.bundle("decode")                  # {CPU: threads[, GPU: share]} + the role's resources
    spec = template.spec_for("decode")                  # the engine a decode worker builds (its TP size in it)

It keeps what every worker of one cluster shares: the engine spec, the concrete KV transport, the
cluster's KV secret (every transport: gRPC streams carry it, gloo/nccl/ipc control connections prove it)
and, for the rank transports, this cluster's namespace, the bundle shape per role. Ranks identify workers
on a rank transport's KV plane: each worker gets its own, never reused, from a rank space far larger than
any worker count, since each pair is a connection and two-rank process group of its own and the world size
only bounds ranks.
"""
from __future__ import annotations

import dataclasses
import secrets
import uuid
from dataclasses import dataclass, field

from cluster.workers.actors import DecodeActor, EngineSpec, PrefillActor
from cluster.workers.cluster_config import ClusterConfig
from cluster.workers.placement_check import worker_bundles
from decode_worker import DecodeWorkerConfig
from decode_worker.no_receiver import NO_TRANSPORT
from kv_transfer import DistRendezvous, TransferConfig
from prefill_worker import PrefillWorkerConfig

RANK_SPACE = 1 << 20  # KV-plane ranks one cluster may hand out over its life (the rendezvous world size)


@dataclass(frozen=True)
class WorkerTemplate:
    """spec: the engine each worker builds. transport: the concrete KV transport (NO_TRANSPORT for
    replicas). gpus / cpu_threads: each worker's bundle and threads. transfer: the senders' config (with the
    cluster secret); receiver_transfer: the decode workers' (their gRPC receiver takes as many streams as
    the most prefill workers may send at once). namespace: the rank transports' (gloo/nccl/ipc) namespace of
    this cluster, None for the others. prefill_tp / decode_tp: the ranks of each worker of the role (a worker of
    more than one is a tensor-parallel group: one bundle per rank, in a placement group of its own)."""

    spec: EngineSpec
    transport: str
    decode_role: str
    gpus: float
    cpu_threads: int
    transfer: TransferConfig
    receiver_transfer: TransferConfig
    namespace: str | None
    max_live_per_decode_worker: int
    expect_timeout_s: float
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    kv_streaming: str = "layer"
    decode_prefix_reuse: bool = True
    prefill_tp: int = 1
    decode_tp: int = 1

    def tp_size(self, role: str) -> int:
        """The ranks (bundles, actors) of one worker of `role`."""
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def spec_for(self, role: str) -> EngineSpec:
        """The engine a worker of `role` builds: spec with the role's tensor-parallel size."""
        size = self.tp_size(role)
        if size == self.spec.engine.tensor_parallel_size:
            return self.spec
        return dataclasses.replace(self.spec, engine=dataclasses.replace(self.spec.engine, tensor_parallel_size=size))

    def group_bundle(self, role: str) -> dict[str, float]:
        """What one worker of `role` takes on its node: its bundle times its ranks (all on one node)."""
        return {key: amount * self.tp_size(role) for key, amount in self.bundle(role).items()}

    @property
    def kv_lanes(self) -> bool:
        """Whether workers of one rank open KV lanes too: the two roles' groups differ in size, so the KV moves
        between their layouts rank to rank (kv_transfer/lanes/parts.py)."""
        return self.prefill_tp != self.decode_tp

    @property
    def ranked(self) -> bool:
        """Whether KV senders and receivers find each other by rank (gloo, nccl, ipc)."""
        return self.namespace is not None

    def bundle(self, role: str) -> dict[str, float]:
        """The placement-group bundle of one worker of `role` (as at start: placement_check.worker_bundles)."""
        resources = self.prefill_resources if role == "prefill" else self.decode_resources
        return worker_bundles([(role, 1, resources)], self.cpu_threads, self.gpus)[0][1]

    def actor_args(self, role: str, name: str, rank: int, peer_ranks: tuple[int, ...] = ()):
        """(actor class, constructor arguments after the EngineSpec) of worker `name`. rank: its KV-plane
        rank (rank transports); peer_ranks: a decode worker's prefill workers' ranks."""
        if role == "prefill":
            per_peer = self.transfer.grpc_max_concurrent_transfers if self.transport == "grpc" else None
            return PrefillActor, (PrefillWorkerConfig(name, self.transport, self.transfer, self._rendezvous(rank),
                                                      max_transfers_per_peer=per_peer,
                                                      kv_streaming=self.kv_streaming, kv_lanes=self.kv_lanes),)
        if role != self.decode_role:
            raise ValueError(f"this cluster has no {role!r} workers (its roles: prefill, {self.decode_role})")
        config = DecodeWorkerConfig(name, self.transport, self.receiver_transfer, rendezvous=self._rendezvous(rank),
                                    peer_ranks=tuple(peer_ranks) if self.ranked else (),
                                    max_live_requests=self.max_live_per_decode_worker,
                                    expect_timeout_s=self.expect_timeout_s, prefix_reuse=self.decode_prefix_reuse,
                                    kv_lanes=self.kv_lanes)
        return DecodeActor, (config, role)

    def _rendezvous(self, rank: int) -> DistRendezvous | None:
        if self.namespace is None:
            return None
        return DistRendezvous(rank, RANK_SPACE, self.namespace)


def worker_template(config: ClusterConfig, spec: EngineSpec, transport: str) -> WorkerTemplate:
    """The template of a cluster about to start, with a new cluster secret (TransferConfig.cluster_secret,
    in every worker's config, not in any repr: the KV receivers of every transport accept only senders
    holding it) and a new namespace for the rank transports' connections (gloo/nccl/ipc).

    gRPC: a prefill worker keeps at most grpc_max_concurrent_transfers transfers in flight to one decode
    worker, and a decode worker's receiver streams as many as all prefill workers may send at once (the
    most the bounds allow; a call past that waits in the receiver's queue)."""
    if config.replicas:  # no KV moves: no receiver, no secret, no rendezvous
        return WorkerTemplate(spec, NO_TRANSPORT, config.decode_role, _worker_gpus(config, spec),
                              config.cpu_threads_per_worker, config.transfer, config.transfer, None,
                              config.max_live_per_decode_worker, config.expect_timeout_s,
                              decode_resources=dict(config.decode_resources), decode_tp=config.decode_tp)
    transfer = dataclasses.replace(config.transfer, cluster_secret=secrets.token_hex(32))
    senders = max(config.num_prefill_workers, config.bounds.max_prefill or 0)
    receiver_transfer = dataclasses.replace(
        transfer, grpc_max_concurrent_transfers=senders * transfer.grpc_max_concurrent_transfers)
    namespace = f"tandem-{uuid.uuid4().hex[:8]}" if transport in ("gloo", "nccl", "ipc") else None
    return WorkerTemplate(spec, transport, config.decode_role, _worker_gpus(config, spec),
                          config.cpu_threads_per_worker, transfer, receiver_transfer, namespace,
                          config.max_live_per_decode_worker, config.expect_timeout_s,
                          dict(config.prefill_resources), dict(config.decode_resources), config.kv_streaming,
                          config.decode_prefix_reuse, config.prefill_tp, config.decode_tp)


def _worker_gpus(config: ClusterConfig, spec: EngineSpec) -> float:
    """Each worker's GPU share: config.gpus_per_worker on CUDA, none on CPU."""
    return config.gpus_per_worker if spec.device == "cuda" else 0.0
