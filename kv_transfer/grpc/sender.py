"""KVSender over the gRPC KVTransfer.Push stream (asyncio gRPC on a dedicated event-loop thread)."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import grpc

from kv_transfer.config import ReceiverAddress, TransferConfig
from kv_transfer.connector import KVSender
from kv_transfer.device_sync import record_ready_event
from kv_transfer.grpc.deadline import Deadline
from kv_transfer.grpc.heap import keep_heap_for_messages
from kv_transfer.grpc.loop_thread import EventLoopThread
from kv_transfer.grpc.push import PipelinedWriter, is_small, request_nbytes, write_manifest, write_transfer
from kv_transfer.grpc.streams import PushStream, StaleStream, StreamPool, call_error
from kv_transfer.layer_stream import release_send_blocks
from kv_transfer.outgoing import OutgoingTransfer, prepare_outgoing
from kv_transfer.pool import KVPoolView
from kv_transfer.results import SendRequest, SendResult, TransferHandle
from kv_transfer.staging import StagingPool
from kv_transfer.status import KVTransferError, TransferStatus
from proto import tandem_pb2


class GrpcSender(KVSender):
    """Each send() is one transfer on a long-lived Push stream to its receiver (`streams.py`: a stream per
    transfer in flight, kept open between transfers): the manifest and each run's bytes in chunks of
    config.grpc_chunk_bytes go out at once, no verdict awaited, and one KVAck comes back saying whether the
    blocks were written. A small transfer carries its checksums in the manifest; a larger one sends the
    manifest before any checksum is taken and trails each run with its checksum (run i is checksummed while
    run i-1 is on the wire). One send() ends within 2 * kv_transfer_timeout_s (the receiver's queue wait,
    then the transfer). Every stream carries config.cluster_secret (if any) as call metadata; a receiver
    that refuses it fails the transfer with UNAUTHENTICATED."""

    def __init__(self, config: TransferConfig, pool: KVPoolView):
        self.config, self.pool = config, pool
        if config.grpc_keep_heap:
            keep_heap_for_messages(config.grpc_chunk_bytes)
        self.staging = StagingPool("cpu", pin_memory=pool.device.type == "cuda",
                                   max_cached_bytes=config.staging_cache_bytes)
        self._loop = EventLoopThread("kv-grpc-send")
        self.streams = StreamPool(config)  # loop thread only; `streams.counts` counts the messages
        self._pending: set[Future] = set()
        self._lock = threading.Lock()
        self.closed = False
        # The receiver may queue a transfer for up to kv_transfer_timeout_s before it bounds the transfer
        # itself by kv_transfer_timeout_s: the sender waits for both.
        self._deadline_s = 2 * config.kv_transfer_timeout_s

    def send(self, peer: ReceiverAddress, request: SendRequest) -> TransferHandle:
        handle = TransferHandle(request.request_id)
        ready = record_ready_event(self.pool)
        with self._lock:
            future = None if self.closed else self._loop.submit(self._transfer(peer.target, request, handle, ready))
            if future is not None:
                self._pending.add(future)
        if future is None:
            release_send_blocks(request, self.pool.free)
            handle.fail(TransferStatus.CANCELLED, "sender is closed")
        else:
            future.add_done_callback(self._forget)  # outside the lock: it may run right here
        return handle

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)

    async def _transfer(self, target: str, request: SendRequest, handle: TransferHandle, ready) -> None:
        """Runs one transfer to completion; always frees the sender blocks, then settles the handle."""
        started = time.monotonic()
        try:
            if handle.cancel_requested.is_set():
                raise KVTransferError(TransferStatus.CANCELLED, "cancelled before it started", request.request_id)
            small = is_small(self.pool, request_nbytes(self.pool, request), request.stream is not None)
            # Small: the checksums go into the manifest (read from the pool here); else they trail the runs
            # and nothing is read from the pool yet. Either way on this thread: no hop for the manifest.
            config = self.config
            outgoing = prepare_outgoing(self.pool, request, self.staging, ready, config.max_run_bytes,
                                        config.direct_min_plane_bytes, not small, config.kv_transfer_timeout_s)
            try:  # a cancel or the deadline cancels this task inside _push; either ends up here
                with Deadline(self._deadline_s):
                    await self._push(target, outgoing, handle, small)
            except asyncio.TimeoutError:  # the builtin TimeoutError from 3.11 on
                raise KVTransferError(TransferStatus.TIMEOUT, f"no ack within {self._deadline_s}s",
                                      request.request_id) from None
            finally:
                self.staging.release(outgoing.staging)
            result: SendResult | KVTransferError = SendResult(
                request.request_id, outgoing.manifest.total_nbytes, time.monotonic() - started)
        except KVTransferError as exc:
            result = exc
        except asyncio.CancelledError:  # this task cancelled (the sender's loop stopping): free and settle anyway
            result = KVTransferError(TransferStatus.CANCELLED, "the sender stopped", request.request_id)
        except Exception as exc:
            result = KVTransferError(TransferStatus.INTERNAL, f"{type(exc).__name__}: {exc}", request.request_id)
        release_send_blocks(request, self.pool.free)
        handle.settle(result)

    async def _push(self, target: str, outgoing: OutgoingTransfer, handle: TransferHandle, small: bool) -> None:
        """Runs the transfer on a stream to target. A reused stream that the receiver had ended before this
        transfer reached it (its handler cancelled, the receiver closing) is replaced once: the receiver never
        saw the transfer, so sending it again cannot deliver it twice."""
        rid = outgoing.manifest.request_id
        for _ in range(2):
            stream = await self.streams.take(target, rid)
            try:
                await self._push_on(stream, outgoing, handle, small)
                return
            except StaleStream:
                continue
        raise KVTransferError(TransferStatus.PEER_FAILED, "the receiver ended two streams in a row", rid)

    async def _push_on(self, stream: PushStream, outgoing: OutgoingTransfer, handle: TransferHandle,
                       small: bool) -> None:
        """Writes the transfer's messages on stream (stopping early if the receiver's ack comes first) and
        reads its one ack. The stream goes back to the pool only after an OK ack with every message written;
        anything else drops it. Raises KVTransferError unless the receiver acked the written blocks."""
        rid = outgoing.manifest.request_id
        loop, push_task, active = asyncio.get_running_loop(), asyncio.current_task(), [True]

        def stop_push() -> None:  # on the loop; a no-op once this transfer is over (the stream may be reused)
            if active[0]:
                self.streams.drop(stream)  # ends a write posted before the call's first metadata too
                push_task.cancel()
        handle.on_cancel(lambda: _run_on(loop, stop_push))
        reusable = False
        try:
            await self._exchange(stream, outgoing, small)
            reusable = True
        except asyncio.CancelledError:
            if not handle.cancel_requested.is_set():
                raise  # the deadline (or the loop stopping) cancelled us: reported by the caller
            _uncancel(push_task)
            raise KVTransferError(TransferStatus.CANCELLED, "cancelled by the sender", rid) from None
        except (KVTransferError, StaleStream):
            if handle.cancel_requested.is_set():  # our cancel ended the stream before the task saw it: no retry
                raise KVTransferError(TransferStatus.CANCELLED, "cancelled by the sender", rid) from None
            raise
        finally:
            active[0] = False
            self.streams.give_back(stream) if reusable else self.streams.drop(stream)

    async def _exchange(self, stream: PushStream, outgoing: OutgoingTransfer, small: bool) -> None:
        """The transfer's messages out and its one ack back on `stream`. Returns once the receiver acked OK
        after every message went out (the stream is then ready for the next transfer); raises KVTransferError
        for a failure ack, a stream that ended without an ack, or an OK ack before the last message."""
        rid, call, manifest_out = outgoing.manifest.request_id, stream.call, False
        final = asyncio.ensure_future(self._read_ack(call, rid))
        writer = PipelinedWriter(call, final, self.streams.counts)
        try:
            manifest_out = await write_manifest(writer, outgoing)
            wrote_all = manifest_out and await write_transfer(writer, outgoing, self.config.grpc_chunk_bytes, small)
            ack = await final
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, KVTransferError) as exc:  # invalid: written
            ack = _ack_if_in(final)  # after the call ended; KVTransferError: no ack (or a streamed layer failed)
            if ack is None and stream.transfers and (not manifest_out or await self.streams.never_started(stream)):
                raise StaleStream() from None  # the receiver had ended the stream before this transfer
            if ack is None:
                raise exc if isinstance(exc, KVTransferError) else await call_error(call, rid, exc) from None
            wrote_all = False
        finally:
            if not final.done():
                final.cancel()
            elif not final.cancelled():
                final.exception()  # retrieved: a write's failure may have been raised instead
        if ack.status != tandem_pb2.KV_OK:
            raise KVTransferError(TransferStatus(ack.status), ack.error or "receiver reported failure", rid)
        if not wrote_all:
            raise KVTransferError(TransferStatus.PEER_FAILED, "the receiver acked before the last message", rid)

    async def _read_ack(self, call, rid: str) -> tandem_pb2.KVAck:
        ack = await call.read()
        if ack is grpc.aio.EOF:
            raise KVTransferError(TransferStatus.PEER_FAILED, "the receiver closed the stream without an ack", rid)
        self.streams.counts["ack"] += 1
        return ack

    def close(self) -> None:
        """Waits for transfers in flight (bounded by the transfer timeout), then closes the streams, the
        channels and the loop."""
        with self._lock:
            self.closed = True
            pending = list(self._pending)
        for future in pending:
            try:
                future.result(self._deadline_s + 5)
            except Exception:
                pass
        self._loop.run(self.streams.close(), timeout=15)
        self._loop.stop()


def _run_on(loop: asyncio.AbstractEventLoop, fn) -> None:
    """Runs fn on loop and, from another thread, waits (up to 1 s) until it ran: a sender's cancel() returns
    with the stream's cancel already on its way to the receiver, which then sees it before it delivers."""
    try:
        if asyncio.get_running_loop() is loop:
            fn()
            return
    except RuntimeError:  # no loop on this thread
        pass
    ran = threading.Event()

    def run() -> None:
        try:
            fn()
        finally:
            ran.set()
    try:
        loop.call_soon_threadsafe(run)
    except RuntimeError:  # the loop is closed: the transfer is long over
        return
    ran.wait(1.0)


def _uncancel(task: asyncio.Task) -> None:
    """Consumes a cancel this transfer turned into its CANCELLED outcome (Python 3.11+ counts them)."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is not None:
        uncancel()


def _ack_if_in(final: asyncio.Future) -> tandem_pb2.KVAck | None:
    """The receiver's ack if it arrived before the stream broke (its status then says what happened)."""
    if final.done() and not final.cancelled() and final.exception() is None:
        return final.result()
    return None
