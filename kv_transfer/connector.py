"""The two roles of the KV transfer plane (vLLM KV-connector style) and how a transport is chosen.

The control side (a KVSender's send()) decides what goes where and describes it in a manifest; the
data side (the transport behind it) moves the bytes. A sender ships blocks of its pool to a
receiver's address; a receiver allocates in its own pool and hands finished transfers to its owner.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kv_transfer.config import ReceiverAddress
from kv_transfer.results import ReceiveInbox, ReceiveOutcome, SendRequest, TransferHandle


class KVSender(ABC):
    """Ships the KV blocks of finished prefills to receivers, each transfer on a background thread."""

    @abstractmethod
    def send(self, peer: ReceiverAddress, request: SendRequest) -> TransferHandle:
        """Starts shipping request.block_ids to peer and returns at once.

        From this call on the transfer owns those blocks: it frees them through the pool's `free` exactly
        once when it ends (acked, failed, timed out or cancelled), before the handle completes. On CUDA the
        blocks must have been written on the caller's current stream (an event recorded here orders the
        copy after it)."""

    @abstractmethod
    def close(self) -> None:
        """Stops the background threads; queued transfers fail with CANCELLED and free their blocks."""


class KVReceiver(ABC):
    """Accepts transfers into its pool; finished ones (delivered or failed) wait in an inbox."""

    inbox: ReceiveInbox

    @property
    @abstractmethod
    def address(self) -> ReceiverAddress:
        """What a sender needs to reach this receiver."""

    def poll(self) -> list[ReceiveOutcome]:
        """Outcomes finished since the last call, without blocking. A ReceivedKV's block ids belong to the
        caller from now on; a ReceiveFailed has nothing left allocated."""
        return self.inbox.poll()

    def wait(self, timeout: float | None = None) -> ReceiveOutcome | None:
        """The next outcome, blocking up to timeout seconds (None: no outcome in time)."""
        return self.inbox.wait(timeout)

    def cancel(self, request_id: str) -> None:
        """Drops request_id: if it is in flight or arrives later, it ends as CANCELLED with its blocks freed
        on both sides (the sender's handle fails with CANCELLED)."""
        self.inbox.cancel(request_id)

    @abstractmethod
    def close(self) -> None:
        """Stops accepting transfers and waits for the ones in flight (bounded by the transfer timeout)."""


def resolve_transport(requested: str, sender_device: torch.device, receiver_device: torch.device,
                      same_host: bool = True) -> str:
    """The concrete transport for a sender/receiver pair.

    auto: nccl when both pools are on CUDA devices that differ (or on different hosts); gloo (host
    staging) when both are on the same CUDA device -- CUDA IPC is not implemented -- and between CPU
    pools on one host; grpc between CPU pools on different hosts. Explicit names are checked."""
    sender_device, receiver_device = torch.device(sender_device), torch.device(receiver_device)
    both_cuda = sender_device.type == receiver_device.type == "cuda"
    if requested == "ipc":
        raise ValueError("transport 'ipc' (CUDA IPC) is not implemented; use nccl, gloo or grpc")
    if requested == "nccl" and not both_cuda:
        raise ValueError("transport 'nccl' needs both KV pools on CUDA devices")
    if requested != "auto":
        return requested
    if both_cuda and (sender_device != receiver_device or not same_host):
        return "nccl"
    return "gloo" if same_host else "grpc"
