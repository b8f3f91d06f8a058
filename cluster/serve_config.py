"""ServeConfig: what `tandem serve` was asked for (cluster/serve.py reads it from the flags), and the
ClusterConfig of the replicas or disaggregated workers it describes."""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.coordinator.autoscaler import AutoscalePolicy
from cluster.workers.cluster_config import ClusterConfig
from cluster.workers.worker_bounds import WorkerBounds
from engine.config import EngineConfig
from kv_transfer.config import TransferConfig


@dataclass(frozen=True)
class ServeConfig:
    model: str | None
    dtype: str
    device: str
    mode: str
    prefill_workers: int
    decode_workers: int
    host: str
    grpc_port: int
    http_port: int
    api_key: str | None
    max_pending_requests: int
    transport: str = "auto"
    address: str | None = None
    placement_strategy: str = "PACK"
    engine: EngineConfig = field(default_factory=EngineConfig)
    cpu_threads: int | None = None
    local_prefill_tokens: int = 0
    worker_stall_timeout_s: float = 30.0
    max_prefill_queue_tokens: int = 1 << 20
    shutdown_grace_s: float = 5.0
    gpus_per_worker: float = 1.0
    node_ip_address: str | None = None
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    replicas: int = 0  # colocated: 0 = one engine in this process, N = N replica actors on Ray
    served_model_names: tuple[str, ...] = ()  # empty: the model path (or "tandem-default")
    kv_streaming: str = "layer"  # disaggregated: KV sent layer by layer under the prefill, or whole after it
    kv_inline_max_bytes: int | None = TransferConfig.inline_max_bytes  # gloo: transfers riding the control link
    disagg_policy: str = "uncached"
    decode_prefix_reuse: bool = True
    bounds: WorkerBounds = field(default_factory=WorkerBounds)  # of the worker set while serving (on Ray)
    drain_timeout_s: float = 300.0
    autoscale: AutoscalePolicy | None = None  # None: the worker set changes only by admin call
    tokenizer: str | None = None  # a Hugging Face tokenizer directory instead of the model's own
    request_read_timeout_s: float = 30.0  # HTTP: a body not arrived by then is answered 408
    max_connections: int = 1024  # HTTP: connections served at once; past it 503
    prefill_tp: int = 1  # ranks of each prefill worker (disaggregated)
    decode_tp: int = 1   # ranks of each decode worker, replica, or of the engine in this process
    warmup_requests: int | None = None  # before listening (serve_warmup.py); None: one per P -> D pair / replica
    decode_room_wait_s: float = 30.0  # on Ray: how long a request waits for room on the decode side before a 429

    @property
    def model_name(self) -> str:
        """The name reported (the first served name)."""
        return self.served_model_names[0] if self.served_model_names else self.model or "tandem-default"


def cluster_config(config: ServeConfig) -> ClusterConfig:
    """The disaggregated cluster (or the colocated replicas: 0 prefill workers) this serve config describes
    (ValueError on an inconsistent one)."""
    return ClusterConfig(model=config.model, tokenizer=config.tokenizer, model_name=config.model_name,
                         dtype=config.dtype, device=config.device, local_prefill_tokens=config.local_prefill_tokens,
                         num_prefill_workers=config.prefill_workers, num_decode_workers=config.decode_workers,
                         transport=config.transport, placement_strategy=config.placement_strategy,
                         engine=config.engine, cpu_threads_per_worker=config.cpu_threads,
                         worker_stall_timeout_s=config.worker_stall_timeout_s,
                         max_prefill_queue_tokens=config.max_prefill_queue_tokens,
                         decode_room_wait_s=config.decode_room_wait_s,
                         gpus_per_worker=config.gpus_per_worker, prefill_resources=config.prefill_resources,
                         decode_resources=config.decode_resources, kv_streaming=config.kv_streaming,
                         disagg_policy=config.disagg_policy, decode_prefix_reuse=config.decode_prefix_reuse,
                         bounds=config.bounds, drain_timeout_s=config.drain_timeout_s, prefill_tp=config.prefill_tp,
                         decode_tp=config.decode_tp,
                         transfer=TransferConfig(inline_max_bytes=config.kv_inline_max_bytes))
