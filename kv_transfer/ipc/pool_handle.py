"""The sender's pool as a handle another process on the same host can map: CUDA IPC, or shared CPU memory.

export_pool(kv) pickles torch.multiprocessing's reduction of the pool tensor (for a CUDA tensor: the
cudaIpcMemHandle of its allocation plus torch's cross-process reference count; for a CPU tensor in shared
memory: its file descriptor, handed over once through multiprocessing's resource sharer). import_pool maps
it in the receiver with the same rebuild functions torch.multiprocessing uses, but unpickles through an
allow-list: a peer can name only those rebuild functions and the torch types they take, never any other
callable. Mapping does not copy: the receiver's tensor is a view of the sender's memory.

CPU pools are for tests and tools on one host: their file descriptor is fetched from the sender's resource
sharer, which only processes of one multiprocessing family can authenticate to (the same authkey: the
pytest process and the peers it spawned). CUDA handles have no such limit, but CUDA refuses to open a
handle in the process that exported it, so sender and receiver must be different processes.
"""
from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

from kv_transfer.pool import DTYPE_NAMES

MAX_HANDLE_BYTES = 64 << 10  # a pickled handle is a few hundred bytes

_REDUCTIONS = "torch.multiprocessing.reductions"
_ALLOWED = {
    (_REDUCTIONS, "rebuild_tensor"), (_REDUCTIONS, "rebuild_cuda_tensor"), (_REDUCTIONS, "rebuild_typed_storage"),
    (_REDUCTIONS, "rebuild_storage_fd"), (_REDUCTIONS, "rebuild_storage_empty"),
    ("torch", "Tensor"), ("torch", "Size"), ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("multiprocessing.resource_sharer", "DupFd"),
} | {("torch", name) for name in DTYPE_NAMES.values()}


class PoolHandleError(ValueError):
    """A handle this process refuses to map (not one export_pool makes) or cannot map (wrong device, a
    sender that went away)."""


def check_exportable(kv: torch.Tensor) -> None:
    """ValueError unless another process can map kv: a CUDA tensor, or a CPU tensor in shared memory (a
    CPU tensor outside it would be moved into shared memory by the reduction, under the engine's feet)."""
    if kv.device.type == "cuda":
        return
    if kv.device.type != "cpu":
        raise ValueError(f"transport 'ipc' maps CUDA or shared CPU pools, not a {kv.device.type} pool")
    if not kv.is_shared():
        raise ValueError("transport 'ipc' with a CPU pool needs the pool tensor in shared memory "
                         "(kv.share_memory_() before the sender is built): the receiver maps it")


def export_pool(kv: torch.Tensor) -> bytes:
    """A fresh handle to kv for one receiver to map once (CPU: its file descriptor is handed out once)."""
    check_exportable(kv)
    return bytes(ForkingPickler.dumps(kv))


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise PoolHandleError(f"a pool handle may not refer to {module}.{name}")
        return super().find_class(module, name)


def import_pool(data: bytes, device: torch.device) -> torch.Tensor:
    """Maps the pool behind a handle from export_pool: a tensor [L, 2, N, bs, H, D] sharing the sender's
    memory, on `device` (this process's pool device). Raises PoolHandleError."""
    if len(data) > MAX_HANDLE_BYTES:
        raise PoolHandleError(f"a pool handle of {len(data)} bytes is longer than {MAX_HANDLE_BYTES}")
    try:
        kv = _AllowListUnpickler(io.BytesIO(data)).load()
    except PoolHandleError:
        raise
    except Exception as exc:  # a truncated pickle, a handle CUDA cannot open, a sender that went away
        raise PoolHandleError(f"could not map the sender's pool: {type(exc).__name__}: {exc}") from None
    if not isinstance(kv, torch.Tensor) or kv.dim() != 6 or kv.shape[1] != 2 or kv.dtype not in DTYPE_NAMES:
        raise PoolHandleError("the handle does not describe a KV pool [L, 2, num_blocks, block_size, H, D]")
    if not kv.is_contiguous():
        raise PoolHandleError("the sender's pool is not contiguous")
    if kv.device != torch.device(device):
        raise PoolHandleError(f"the sender's pool is on {kv.device}, this pool on {device}: transport 'ipc' "
                              "copies within one device")
    return kv
