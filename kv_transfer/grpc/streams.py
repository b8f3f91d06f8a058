"""The gRPC sender's long-lived Push streams: a stream carries one transfer at a time and many in turn.

A transfer takes an idle stream to its receiver (or opens one: a channel per receiver, a stream per
transfer in flight) and gives it back once the receiver's OK ack has arrived and every message of the
transfer was written, so both ends agree where the next transfer starts. Any other ending (a failure ack,
a cancel, a deadline, a broken stream) drops the stream: the next transfer opens a fresh one. Used only
from the sender's event-loop thread (no locks).
"""
from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

import grpc

from kv_transfer.config import TransferConfig
from kv_transfer.grpc.auth import TRANSFERS_METADATA_KEY, asks_for_session, session_metadata
from kv_transfer.grpc.codec import PUSH_PATH, channel_options
from kv_transfer.status import KVTransferError, TransferStatus
from proto import tandem_pb2

IDLE_STREAMS_PER_RECEIVER = 8  # idle streams kept open to one receiver; more are closed when given back

_GRPC_TO_STATUS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: TransferStatus.TIMEOUT,
    grpc.StatusCode.CANCELLED: TransferStatus.CANCELLED,
    grpc.StatusCode.UNAUTHENTICATED: TransferStatus.UNAUTHENTICATED,  # not this receiver's cluster secret
}


class StaleStream(Exception):
    """A reused stream the receiver had ended before the transfer now on it reached the receiver."""


@dataclass(eq=False)
class PushStream:
    """One open Push call to `target`, in session mode (the receiver confirmed it)."""

    target: str
    call: grpc.aio.StreamStreamCall
    transfers: int = 0  # transfers it has carried to an OK ack


class StreamPool:
    """The idle session streams per receiver, and the channels they run on. `counts` counts what crossed the
    streams (tests read it): manifest, data, run_checksum and tail messages out, acks in, streams opened."""

    def __init__(self, config: TransferConfig):
        self.config = config
        self._metadata = session_metadata(config.cluster_secret)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._idle: dict[str, list[PushStream]] = {}
        self._retiring: set[asyncio.Future] = set()  # half-closes of streams beyond the idle limit
        self.counts: Counter[str] = Counter()

    async def take(self, target: str, request_id: str) -> PushStream:
        """An idle stream to target that is still open, else a new one (opened and confirmed by the
        receiver). Raises KVTransferError (UNAUTHENTICATED, PEER_FAILED, ...) when none can be opened."""
        idle = self._idle.get(target, [])
        while idle:
            stream = idle.pop()
            if not stream.call.done():
                return stream
        return await self._open(target, request_id)

    async def _open(self, target: str, request_id: str) -> PushStream:
        """Opens a stream and waits for the receiver's headers before anything is written: a receiver that
        refuses it (UNAUTHENTICATED) has then ended the call, and its status is reported as it is (a write
        racing with the refusal would make grpc-python report INTERNAL instead)."""
        if target not in self._channels:
            options = channel_options(self.config.grpc_max_message_bytes)
            self._channels[target] = grpc.aio.insecure_channel(target, options=options)
        push = self._channels[target].stream_stream(PUSH_PATH, request_serializer=None,
                                                    response_deserializer=tandem_pb2.KVAck.FromString)
        call = push(metadata=self._metadata)
        self.counts["streams_opened"] += 1
        headers = await call.initial_metadata()
        if call.done():
            raise await call_error(call, request_id)
        if not asks_for_session(headers):
            call.cancel()
            raise KVTransferError(TransferStatus.INTERNAL, f"the receiver at {target} does not keep Push streams "
                                  "open (an older version?)", request_id)
        return PushStream(target, call)

    def give_back(self, stream: PushStream) -> None:
        """Keeps a stream whose transfer ended with the receiver's OK ack for the next transfer to its receiver
        (up to IDLE_STREAMS_PER_RECEIVER; a stream beyond that is closed)."""
        stream.transfers += 1
        idle = self._idle.setdefault(stream.target, [])
        if len(idle) < IDLE_STREAMS_PER_RECEIVER and not stream.call.done():
            idle.append(stream)
        elif not stream.call.done():  # half-closed, never cancelled: a cancel right after the ack could cancel
            retiring = asyncio.ensure_future(_half_close(stream))  # the receiver's write of it (PEER_FAILED)
            self._retiring.add(retiring)
            retiring.add_done_callback(self._retiring.discard)

    @staticmethod
    async def never_started(stream: PushStream) -> bool:
        """For a stream that failed without an ack: whether the receiver ended it before it read the manifest
        now on it (its trailing metadata counts the transfers it began: one per OK ack before this one).
        Waits up to 1 s for the call's status; False when it does not say."""
        if stream.transfers == 0:
            return False
        try:
            await asyncio.wait_for(stream.call.code(), 1.0)
            trailing = await stream.call.trailing_metadata()
        except Exception:  # no status in time, or none readable: assume the receiver saw the transfer
            return False
        return any(key == TRANSFERS_METADATA_KEY and value == str(stream.transfers) for key, value in trailing or ())

    @staticmethod
    def drop(stream: PushStream) -> None:
        """Ends a stream that may be mid-transfer: the receiver sees the call cancelled (if it is not over)."""
        stream.call.cancel()

    @property
    def num_idle(self) -> int:
        """Idle streams still open (tests read it)."""
        return sum(not stream.call.done() for idle in self._idle.values() for stream in idle)

    async def close(self) -> None:
        """Half-closes every idle stream (the receiver ends it without an outcome), then closes the channels,
        which cancels whatever is still open."""
        for idle in self._idle.values():
            for stream in idle:
                await _half_close(stream)
        self._idle.clear()
        if self._retiring:
            await asyncio.wait(list(self._retiring), timeout=1.0)
        for channel in self._channels.values():
            await channel.close(grace=1.0)
        self._channels.clear()


async def _half_close(stream: PushStream) -> None:
    """Ends a stream between transfers the polite way: the receiver reads EOF and ends it without an outcome."""
    try:
        await stream.call.done_writing()
    except Exception:  # already over
        pass


async def call_error(call, rid: str, exc: Exception | None = None) -> KVTransferError:
    """The KVTransferError for a call that failed (with exc): the gRPC status it raised, else the status the
    ended call carries (UNAUTHENTICATED -> UNAUTHENTICATED, DEADLINE_EXCEEDED -> TIMEOUT, ... PEER_FAILED)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        code, details = exc.code(), exc.details()
    elif call.done():
        code, details = await call.code(), await call.details()
    else:  # a write after our own half-close: not the receiver's doing
        return KVTransferError(TransferStatus.INTERNAL, f"{type(exc).__name__}: {exc}", rid)
    return KVTransferError(_GRPC_TO_STATUS.get(code, TransferStatus.PEER_FAILED), f"{code.name}: {details}", rid)
