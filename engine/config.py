"""Frozen configuration: what the model is (ModelConfig) and how the engine runs it (EngineConfig)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu_kernel")
PREFILL_FIRST_MODES = ("auto", "on", "off")
# On CUDA, while sequences decode, a step takes at most this many prompt tokens by default: a Llama-3-8B-shaped
# 2,048-token chunk is ~33 TFLOP, ~60 ms of an H100's bf16 matmuls, so 256 decodes beside a 16k prompt wait well
# under issue 27's 150 ms per step (an H100 took 352 ms with the 8,192-token steps of an unbounded budget).
CUDA_PREFILL_BOUND = 2048


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling as in Hugging Face's `rope_scaling` / `rope_parameters`."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from a Hugging Face config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple "
                             f"of num_key_value_heads {self.num_kv_heads}")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model directory {model_dir!s} has no config.json")
        return cls.from_hf_dict(json.loads(path.read_text()))

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = hf["num_attention_heads"]
        # Qwen2 hard-codes a q/k/v bias; Llama, Mistral and Qwen3 put `attention_bias` on q/k/v/o alike.
        attention_bias = bool(hf.get("attention_bias", False))
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
            o_proj_bias=attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(hf.get("eos_token_id")),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
        )


def _rope_params(hf: dict) -> dict:
    # transformers >= 5 writes `rope_parameters`; older checkpoints write `rope_scaling` + `rope_theta`.
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _rope_theta(hf: dict) -> float:
    return float(hf.get("rope_theta") or _rope_params(hf).get("rope_theta") or 10000.0)


def _rope_scaling(hf: dict) -> RopeScaling:
    params = _rope_params(hf)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return RopeScaling()
    return RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _sliding_window(hf: dict) -> int | None:
    if hf.get("use_sliding_window") is False:
        return None
    window = hf.get("sliding_window")
    return int(window) if window else None


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: KV pool, batching limits, device.

    kv_cache_memory sizes the KV pool in bytes (CPU, or GPU when set); on GPU without it the pool
    takes gpu_memory_utilization of the device memory minus the weights, the measured peak activations
    and the CUDA graph pools (engine/runner/memory_plan.py).
    num_kv_blocks, when set, overrides both (tests use it to force preemption).
    long_prefill_token_threshold (> 0, with chunked prefill): no prompt takes more than this many tokens
    of a step, so a long prompt's prefill leaves room for the prompts queued behind it (vLLM's knob of
    the same name); 0 lets one prompt take the whole budget.
    max_prefill_tokens_while_decoding (> 0, with chunked prefill): while any sequence decodes, no step takes
    more prompt tokens than this, so no decode waits more than one such step's prompt work between two tokens
    (engine/core/scheduler.py); 0: max_num_batched_tokens is the only bound. None (auto): CUDA_PREFILL_BOUND on
    CUDA with chunked prefill, no bound on CPU (`prefill_bound_on`).
    prefill_backlog_steps (>= 0): N > 0 spreads a backlog of prompts over about N steps: a step that holds decodes
    may take the prompt tokens still to compute over N when that is more than the bound (engine/core/scheduler.py),
    so a queue the bounded steps fall behind is worked down without carrying every decode once per prompt, and a
    queue shorter than N bounded steps keeps the bound. 0: the bound always holds.
    attention_backend: "auto" (triton on CUDA, the numba kernel on CPU float32, torch otherwise),
    "torch" (gather + SDPA), "triton" (paged kernels; on CPU only under TRITON_INTERPRET=1) or
    "cpu_kernel" (numba, CPU float32 only). Availability on the device is checked when the engine starts.
    enforce_eager: no CUDA graphs (they are captured only on CUDA).
    mixed_graph_max_tokens: the steps that hold prompt chunks (prefill and mixed steps) of at most this many tokens
    (and max_num_batched_tokens) replay piecewise CUDA graphs, the attention eager between the pieces
    (engine/runner/mixed_graphs.py); 0: they run eager. CUDA with the triton backend and one rank only.
    tensor_parallel_size: ranks the model is split over (engine/parallel/): this process is rank 0 and
    schedules, N - 1 follower processes (one GPU each on CUDA, a share of the cores on CPU) run each step's
    forward with it. kv_cache_memory, num_kv_blocks and gpu_memory_utilization are per rank.
    tp_cpu_all_reduce: on CPU, "shared_memory" (the ranks' all-reduces through a shared memory file, spinning:
    engine/parallel/host_reduce.py) or "gloo" (every collective through gloo; slower, kept to measure against).
    tp_start_method: how the follower processes start. "spawn": each a fresh interpreter (~3 s of imports on a
    small CPU); "forkserver": each forked from multiprocessing's fork server, which imported torch and the engine
    once and then stays for the life of this process (a follower starts in ~0.1 s; the server only imports, it never
    touches a GPU; measured on CPU).
    prefill_first: "on": while sequences decode, waiting prompts that one step finishes, of at most 4 tokens
    together per decoding sequence, get a step of their own ahead of the decodes' next token
    (never two such steps in a row, so a decode waits at most one prompt step); "off" mixes them into the
    decode step (Sarathi); "auto" is on for CPU and off for CUDA (engine/core/scheduler.py says why).
    async_scheduling: the host schedules step N + 1 while the device runs step N, whose picks feed step N + 1 on
    the device (engine/core/step_pipeline.py); outputs are the same with it on or off. None (auto): on for CUDA
    with one rank, off otherwise (on CPU the forward runs on the host itself: nothing overlaps). True with
    tensor_parallel_size > 1 is refused (the other ranks take the step's ids from rank 0's host message).
    kv_cache_resident: on CPU, commit every page of the KV pool at start (~0.35 s a GiB), as vLLM's CPU server
    allocates its pool, so no K/V store waits on a page fault: until each block has been used once, a fault per
    4 KiB written cost a 512-token prompt of the default model ~4% of its prefill (engine/kv/host_pages.py). False: the
    pages are committed as first written, so a large pool costs nothing until used. `tandem serve` turns it on.
    warmup: run every kind of step once at start (engine/core/warmup.py), so no request pays for a kernel compile
    or an autotune. None (auto): on for CUDA, off on CPU (nothing compiles there).
    """

    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_prefill_tokens_while_decoding: int | None = None
    prefill_backlog_steps: int = 0
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.85
    num_kv_blocks: int | None = None
    seed: int = 0
    attention_backend: str = "auto"
    enforce_eager: bool = False
    mixed_graph_max_tokens: int = 2048
    prefill_first: str = "auto"
    tensor_parallel_size: int = 1
    tp_cpu_all_reduce: str = "shared_memory"
    tp_start_method: str = "spawn"
    async_scheduling: bool | None = None
    kv_cache_resident: bool = False
    warmup: bool | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        bound = self.max_prefill_tokens_while_decoding
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
            raise ValueError("max_prefill_tokens_while_decoding must be None (auto) or an int >= 0 (0: no bound "
                             f"but max_num_batched_tokens), got {bound!r}")
        backlog = self.prefill_backlog_steps
        if isinstance(backlog, bool) or not isinstance(backlog, int) or backlog < 0:
            raise ValueError(f"prefill_backlog_steps must be an int >= 0 (0: the bound always holds), got {backlog!r}")
        if self.max_prefill_tokens_while_decoding and not self.enable_chunked_prefill:
            raise ValueError("max_prefill_tokens_while_decoding needs enable_chunked_prefill")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}; "
                             f"expected one of {ATTENTION_BACKENDS}")
        if self.prefill_first not in PREFILL_FIRST_MODES:
            raise ValueError(f"unknown prefill_first {self.prefill_first!r}; expected one of {PREFILL_FIRST_MODES}")
        if not isinstance(self.tensor_parallel_size, int) or isinstance(self.tensor_parallel_size, bool) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {self.tensor_parallel_size!r}")
        if not isinstance(self.kv_cache_resident, bool):
            raise ValueError(f"kv_cache_resident must be a bool, got {self.kv_cache_resident!r}")
        if self.tp_cpu_all_reduce not in ("shared_memory", "gloo"):
            raise ValueError(f"tp_cpu_all_reduce must be 'shared_memory' or 'gloo', got {self.tp_cpu_all_reduce!r}")
        if self.tp_start_method not in ("spawn", "forkserver"):
            raise ValueError(f"tp_start_method must be 'spawn' or 'forkserver', got {self.tp_start_method!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        graph_tokens = self.mixed_graph_max_tokens
        if isinstance(graph_tokens, bool) or not isinstance(graph_tokens, int) or graph_tokens < 0:
            raise ValueError(f"mixed_graph_max_tokens must be an int >= 0 (0: none), got {graph_tokens!r}")
        if not (self.async_scheduling is None or isinstance(self.async_scheduling, bool)):
            raise ValueError(f"async_scheduling must be True, False or None (auto), got {self.async_scheduling!r}")
        if not (self.warmup is None or isinstance(self.warmup, bool)):
            raise ValueError(f"warmup must be True, False or None (auto), got {self.warmup!r}")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling needs tensor_parallel_size 1: the other ranks take each step's token "
                             "ids from rank 0's host message, which cannot carry picks still on the device")

    def prefill_bound_on(self, device_type: str) -> int:
        """max_prefill_tokens_while_decoding resolved for a device type (None: CUDA_PREFILL_BOUND on CUDA with
        chunked prefill, else 0, no bound)."""
        if self.max_prefill_tokens_while_decoding is None:
            return CUDA_PREFILL_BOUND if device_type == "cuda" and self.enable_chunked_prefill else 0
        return self.max_prefill_tokens_while_decoding

    def async_scheduling_on(self, device_type: str) -> bool:
        """async_scheduling resolved for a device type (None: on for CUDA with one rank)."""
        if self.async_scheduling is None:
            return device_type == "cuda" and self.tensor_parallel_size == 1
        return self.async_scheduling


def max_model_len(model_config: ModelConfig, config: EngineConfig, num_blocks: int) -> int:
    """The longest sequence served: the model's context, capped by the user's max_model_len, by a
    sliding window (served exactly only within it) and by what the whole KV pool can hold."""
    limits = [model_config.max_position_embeddings, num_blocks * config.block_size]
    if config.max_model_len is not None:
        limits.append(config.max_model_len)
    if model_config.sliding_window is not None:
        limits.append(model_config.sliding_window)
    return min(limits)
