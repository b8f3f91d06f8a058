"""The two roles of the KV transfer plane (vLLM KV-connector style) and how a transport is chosen.

The control side (a KVSender's send()) decides what goes where and describes it in a manifest; the
data side (the transport behind it) moves the bytes. A sender ships blocks of its pool to a
receiver's address; a receiver allocates in its own pool and hands finished transfers to its owner.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

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

    def forget_peer(self, peer: ReceiverAddress) -> None:
        """The receiver at `peer` is gone for good (a decode worker drained away) and nothing is queued for
        it: what this sender keeps for it (a rank transport's link thread and channel) is closed. No-op by
        default and for a peer it never sent to."""


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

    def deliver_to(self, sink: Callable[[ReceiveOutcome], None]) -> None:
        """Every outcome from now on (and any not yet polled) goes to sink(outcome) on the transport's own
        thread, the moment it is settled, instead of to poll()/wait(): a decode worker hands landed KV to its
        step thread's queue with no thread between. sink must not block."""
        self.inbox.forward_to(sink)

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

    @property
    def dropped_connections(self) -> dict[str, int]:
        """Peers refused before anything was read from them, by reason (gRPC: streams without the cluster
        secret; gloo/nccl/ipc: connections that failed the handshake, garbage, too slow, not a peer). Counts
        since the receiver started; each drop is logged too."""
        return {}

    def add_peer(self, rank: int) -> None:
        """Rank transports (gloo/nccl/ipc) listen to sender `rank` from now on too (a prefill worker added
        while serving). No-op by default: a transport that accepts any sender (grpc) has nothing to do."""

    def remove_peer(self, rank: int) -> None:
        """Stop listening to sender `rank` (a prefill worker that left, with no transfer under way). No-op
        by default and for a rank this receiver does not listen to."""


def resolve_transport(requested: str, sender_device: torch.device, receiver_device: torch.device,
                      same_host: bool = True) -> str:
    """The concrete transport for a sender/receiver pair.

    auto: ipc when both pools are on the same CUDA device of one host (the receiver copies straight out of
    the sender's pool); nccl when both are on CUDA devices that differ (or on different hosts); otherwise
    gloo on one host and grpc across hosts. Explicit names are checked: ValueError says why a pair cannot
    use them.
    (ipc between CPU pools in shared memory exists for tests: build it with create_sender/create_receiver.)"""
    sender_device, receiver_device = torch.device(sender_device), torch.device(receiver_device)
    both_cuda = sender_device.type == receiver_device.type == "cuda"
    one_gpu = both_cuda and sender_device == receiver_device and same_host
    if requested == "ipc" and not one_gpu:
        where = "on different hosts" if not same_host else f"on {sender_device} and {receiver_device}"
        raise ValueError(f"transport 'ipc' (CUDA IPC) needs both KV pools on the same CUDA device of one host, "
                         f"they are {where}; use nccl, gloo or grpc")
    if requested == "nccl" and not both_cuda:
        raise ValueError("transport 'nccl' needs both KV pools on CUDA devices")
    if requested != "auto":
        return requested
    if one_gpu:
        return "ipc"
    if both_cuda:
        return "nccl"
    return "gloo" if same_host else "grpc"
