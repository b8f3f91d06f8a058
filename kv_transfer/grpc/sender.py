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
from kv_transfer.grpc.auth import secret_metadata
from kv_transfer.grpc.codec import (PUSH_PATH, channel_options, chunk_parts, encode_checksum_chunk, encode_data_chunk,
                                    encode_manifest_chunk, encode_tail_chunk)
from kv_transfer.grpc.heap import keep_heap_for_messages
from kv_transfer.grpc.loop_thread import EventLoopThread
from kv_transfer.layer_stream import release_send_blocks
from kv_transfer.outgoing import OutgoingTransfer, prepare_outgoing
from kv_transfer.pool import KVPoolView
from kv_transfer.results import SendRequest, SendResult, TransferHandle
from kv_transfer.staging import StagingPool
from kv_transfer.status import KVTransferError, TransferStatus
from proto import tandem_pb2

_GRPC_TO_STATUS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: TransferStatus.TIMEOUT,
    grpc.StatusCode.CANCELLED: TransferStatus.CANCELLED,
    grpc.StatusCode.UNAUTHENTICATED: TransferStatus.UNAUTHENTICATED,  # not this receiver's cluster secret
}


class GrpcSender(KVSender):
    """Each send() is one bidirectional Push stream: the manifest chunk, the server's verdict, each run's
    bytes in chunks of config.grpc_chunk_bytes followed by its checksum, and the final KVAck saying whether
    the blocks were written. The manifest goes out before any checksum is taken: run i is checksummed while
    the verdict (i = 0) or run i-1 is on the wire. One send() ends within 2 * kv_transfer_timeout_s (the
    receiver's queue wait, then the transfer). Every stream carries config.cluster_secret (if any) as call
    metadata; a receiver that refuses it fails the transfer with UNAUTHENTICATED."""

    def __init__(self, config: TransferConfig, pool: KVPoolView):
        self.config, self.pool = config, pool
        self._metadata = secret_metadata(config.cluster_secret)
        if config.grpc_keep_heap:
            keep_heap_for_messages(config.grpc_chunk_bytes)
        self.staging = StagingPool("cpu", pin_memory=pool.device.type == "cuda", max_cached_bytes=config.staging_cache_bytes)
        self._loop = EventLoopThread("kv-grpc-send")
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._answered: set[str] = set()  # targets whose receiver has accepted a stream (loop thread only)
        self._pending: set[Future] = set()
        self._lock = threading.Lock()
        self.closed = False
        # The receiver may queue a transfer for up to kv_transfer_timeout_s before it bounds the transfer
        # itself by kv_transfer_timeout_s: the sender waits for both.
        self._deadline_s = 2 * config.kv_transfer_timeout_s

    def send(self, peer: ReceiverAddress, request: SendRequest) -> TransferHandle:
        handle = TransferHandle(request.request_id)
        ready = record_ready_event(self.pool.device)
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
        started, loop = time.monotonic(), asyncio.get_running_loop()
        try:
            if handle.cancel_requested.is_set():
                raise KVTransferError(TransferStatus.CANCELLED, "cancelled before it started", request.request_id)
            outgoing = await loop.run_in_executor(None, prepare_outgoing, self.pool, request, self.staging, ready,
                                                  self.config.max_run_bytes, self.config.direct_min_plane_bytes, True,
                                                  self.config.kv_transfer_timeout_s)
            try:  # wait_for runs the push as its own task: a cancel or the deadline stops only it
                await asyncio.wait_for(self._push(target, outgoing, handle), self._deadline_s)
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

    def _stub(self, target: str):
        if target not in self._channels:
            options = channel_options(self.config.grpc_max_message_bytes)
            self._channels[target] = grpc.aio.insecure_channel(target, options=options)
        return self._channels[target].stream_stream(
            PUSH_PATH, request_serializer=None, response_deserializer=tandem_pb2.KVAck.FromString)

    async def _push(self, target: str, outgoing: OutgoingTransfer, handle: TransferHandle) -> None:
        """Manifest, wait for the verdict (the receiver may queue the transfer first), stream the runs
        (stopping early if the server gives up), read the final ack. Raises KVTransferError unless the
        receiver acked the written blocks."""
        rid = outgoing.manifest.request_id
        call = self._stub(target)(timeout=self._deadline_s, metadata=self._metadata)
        loop, push_task = asyncio.get_running_loop(), asyncio.current_task()

        def stop_push() -> None:
            # Cancelling only the call can leave a write that was posted before the call's first metadata
            # waiting forever; cancelling the push task always ends it.
            call.cancel()
            push_task.cancel()
        handle.on_cancel(lambda: loop.call_soon_threadsafe(stop_push))
        first_checksum: asyncio.Future | None = None
        try:
            await self._opened(call, target, rid)
            await call.write(encode_manifest_chunk(outgoing.manifest_bytes))
            first_checksum = _checksum_soon(outgoing, 0)  # while the verdict travels
            ack = await self._read_ack(call, rid)
            if ack.final:  # rejected: nothing more to send
                await call.done_writing()
            else:
                final = asyncio.ensure_future(self._read_ack(call, rid))
                await self._write_runs(call, outgoing, final, first_checksum)
                await call.done_writing()
                ack = await final
            if ack.status == tandem_pb2.KV_OK:  # a cancel while this waits is a cancel like any other
                await _settled_with(call, rid)
        except KVTransferError:  # a streamed layer or tail that will not come: the receiver frees on the cancel
            call.cancel()
            raise
        except asyncio.CancelledError:
            if not handle.cancel_requested.is_set():
                raise  # the deadline (wait_for) cancelled us: reported as TIMEOUT by the caller
            raise KVTransferError(TransferStatus.CANCELLED, "cancelled by the sender", rid) from None
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:  # invalid: written after the call ended
            self._answered.discard(target)  # the next stream to it waits for the receiver's answer again
            raise await _call_error(call, rid, exc) from None
        finally:  # nothing may still read the pool once the caller frees the blocks
            if first_checksum is not None:
                await asyncio.wait([first_checksum])
        if ack.status != tandem_pb2.KV_OK:
            raise KVTransferError(TransferStatus(ack.status), ack.error or "receiver reported failure", rid)

    async def _opened(self, call, target: str, rid: str) -> None:
        """On the first stream to a target (and after one that failed), waits for the receiver's first
        answer (it sends its headers at once) before writing: a receiver that refuses the stream
        (UNAUTHENTICATED: not this cluster's secret) has then ended the call, and its status is reported as
        it is; a write racing with the refusal would fail with INTERNAL instead. Later streams do not wait."""
        if target in self._answered:
            return
        await call.initial_metadata()
        if call.done():
            raise await _call_error(call, rid)
        self._answered.add(target)

    @staticmethod
    async def _read_ack(call, rid: str) -> tandem_pb2.KVAck:
        ack = await call.read()
        if ack is grpc.aio.EOF:
            raise KVTransferError(TransferStatus.PEER_FAILED, "the receiver closed the stream without an ack", rid)
        return ack

    async def _write_runs(self, call, outgoing: OutgoingTransfer, final: asyncio.Future,
                          first_checksum: asyncio.Future) -> None:
        """Writes every piece (a run, or a streamed layer) in chunks of grpc_chunk_bytes (a chunk may span pool
        planes), each followed by its checksum, then a streamed transfer's tail; stops as soon as the final
        ack has arrived. Piece i+1 is gathered (if it is not direct; a streamed layer once the step wrote it)
        and checksummed on the default executor while piece i streams."""
        gathering, summing = _gather_soon(outgoing, 0), first_checksum
        writer = _PipelinedWriter(call, final)
        try:
            for index in range(outgoing.num_pieces):
                await gathering
                if index + 1 < outgoing.num_pieces:
                    gathering = _gather_soon(outgoing, index + 1)
                pieces = (memoryview(piece.numpy()) for piece in outgoing.pieces(index))
                for parts in chunk_parts(pieces, self.config.grpc_chunk_bytes):
                    if not await writer.write(encode_data_chunk(parts)):  # encoded while the previous chunk sends
                        return
                checksum = await summing
                if index + 1 < outgoing.num_pieces:
                    summing = _checksum_soon(outgoing, index + 1)
                if not await writer.write(encode_checksum_chunk(checksum)):
                    return
            tail = await asyncio.get_running_loop().run_in_executor(None, outgoing.tail)
            if tail is not None and not await writer.write(encode_tail_chunk(tail)):
                return
            await writer.flush()
        finally:  # staging is released after we return: no gather may still be writing into it
            await writer.abandon()
            await asyncio.wait([gathering, summing])
            for future in (gathering, summing):  # their errors (a stream that stopped) are reported elsewhere
                if not future.cancelled():
                    future.exception()

    def close(self) -> None:
        """Waits for transfers in flight (bounded by the transfer timeout), then closes channels and the loop."""
        with self._lock:
            self.closed = True
            pending = list(self._pending)
        for future in pending:
            try:
                future.result(self._deadline_s + 5)
            except Exception:
                pass
        for channel in self._channels.values():
            self._loop.run(channel.close(), timeout=10)
        self._loop.stop()


async def _call_error(call, rid: str, exc: Exception | None = None) -> KVTransferError:
    """The KVTransferError for a call that failed (with exc): the gRPC status it raised, else the status the
    ended call carries (UNAUTHENTICATED -> UNAUTHENTICATED, DEADLINE_EXCEEDED -> TIMEOUT, ... PEER_FAILED)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        code, details = exc.code(), exc.details()
    elif call.done():
        code, details = await call.code(), await call.details()
    else:  # a write after our own half-close: not the receiver's doing
        return KVTransferError(TransferStatus.INTERNAL, f"{type(exc).__name__}: {exc}", rid)
    return KVTransferError(_GRPC_TO_STATUS.get(code, TransferStatus.PEER_FAILED), f"{code.name}: {details}", rid)


def _gather_soon(outgoing: OutgoingTransfer, index: int) -> asyncio.Future:
    """Starts gathering run `index` on the default executor; a finished future for a direct run, which
    travels from the pool as it is (no thread hop)."""
    loop = asyncio.get_running_loop()
    if outgoing.direct[index]:
        done = loop.create_future()
        done.set_result(None)
        return done
    return loop.run_in_executor(None, outgoing.gather, index)


def _checksum_soon(outgoing: OutgoingTransfer, index: int) -> asyncio.Future:
    """Starts checksumming run `index` (from the sender's pool) on the default executor."""
    return asyncio.get_running_loop().run_in_executor(None, outgoing.checksum, index)


class _PipelinedWriter:
    """Writes messages to a call one at a time, handing message k+1 to gRPC only after message k was
    taken, so the caller can build k+1 while k is sent; stops writing once `final` (the receiver's final
    ack) has arrived."""

    def __init__(self, call, final: asyncio.Future):
        self.call, self.final = call, final
        self.writing: asyncio.Future | None = None

    async def write(self, message: bytes) -> bool:
        """Queues message after the previous one; False (nothing written) once the final ack is in."""
        await self.flush()
        if self.final.done():
            return False
        self.writing = asyncio.ensure_future(self.call.write(message))
        await asyncio.sleep(0)  # let the write hand the message to gRPC before the caller builds the next
        return True

    async def flush(self) -> None:
        if self.writing is not None:
            await self.writing

    async def abandon(self) -> None:
        """Cancels a write still in flight (the message is our own copy; the call is failing anyway)."""
        if self.writing is None:
            return
        if not self.writing.done():
            self.writing.cancel()
        await asyncio.wait([self.writing])
        if not self.writing.cancelled():
            self.writing.exception()  # retrieved: the error that ended the call is reported elsewhere


async def _settled_with(call, rid: str) -> None:
    """After an OK final ack: waits for the receiver's handler to end the call. The receiver delivers only
    once its ack went out and its handler returns, so a call that ends otherwise (the ack's write was
    cancelled under it: the receiver has freed the blocks and reported the transfer failed) fails here too,
    and both sides agree. Leaving the call before its status would cancel it and could cause just that."""
    code = await call.code()
    if code != grpc.StatusCode.OK:
        raise KVTransferError(TransferStatus.PEER_FAILED, f"the receiver ended the call with {code.name} after "
                                                          "its final ack", rid)
