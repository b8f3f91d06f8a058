"""KVReceiver serving the gRPC KVTransfer.Push stream (asyncio gRPC server on its own loop thread)."""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc

from kv_transfer.config import ReceiverAddress, TransferConfig
from kv_transfer.connector import KVReceiver
from kv_transfer.grpc.admission import AdmissionQueue
from kv_transfer.grpc.auth import (REFUSAL, SESSION_METADATA, TRANSFERS_METADATA_KEY, asks_for_session,
                                  is_authorized)
from kv_transfer.grpc.codec import PUSH_METHOD, SERVICE_NAME, channel_options
from kv_transfer.grpc.deadline import Deadline
from kv_transfer.grpc.heap import keep_heap_for_messages
from kv_transfer.grpc.inbound import arrived, decode_first, drain, land_chunk, manifest_of, next_chunk
from kv_transfer.grpc.loop_thread import EventLoopThread, off_loop
from kv_transfer.grpc.push import is_small
from kv_transfer.incoming import IncomingTransfer
from kv_transfer.manifest import Manifest
from kv_transfer.pool import KVPoolView
from kv_transfer.results import ReceivedKV, ReceiveFailed, ReceiveInbox
from kv_transfer.staging import StagingPool
from kv_transfer.status import KVTransferError, TransferStatus
from proto import tandem_pb2

log = logging.getLogger(__name__)


def _ack(status: TransferStatus, request_id: str = "", error: str = "", nbytes: int = 0,
         final: bool = True) -> tandem_pb2.KVAck:
    return tandem_pb2.KVAck(status=int(status), request_id=request_id, error=error, bytes_received=nbytes, final=final)


class GrpcReceiver(KVReceiver):
    """Binds host:port (port 0 picks a free one) and accepts Push streams into the pool: up to
    config.grpc_max_concurrent_transfers transfers at once, up to config.grpc_max_queued_transfers more
    waiting in arrival order (their manifests read, nothing allocated), any further one rejected
    (REJECTED_BUSY). A stream whose metadata asks for a session carries one transfer after another (each:
    manifest and chunks in, one final ack out; `GrpcSender` opens these); any other stream carries one
    transfer with an accept ack after its manifest. With config.cluster_secret, a stream without it is
    ended UNAUTHENTICATED before anything is read (counted in `unauthenticated`, nothing in the inbox).
    `counts` counts the acks sent (verdict, final) and the sessions opened."""

    def __init__(self, config: TransferConfig, pool: KVPoolView, host: str = "127.0.0.1", port: int = 0):
        self.config, self.pool = config, pool
        self.inbox = ReceiveInbox(config.cancel_ttl_s)
        if config.grpc_keep_heap:
            keep_heap_for_messages(config.grpc_chunk_bytes)
        self.staging = StagingPool("cpu", pin_memory=pool.device.type == "cuda",
                                   max_cached_bytes=config.staging_cache_bytes)
        self._loop = EventLoopThread("kv-grpc-recv")
        self._lander = ThreadPoolExecutor(1, thread_name_prefix="kv-grpc-land")
        self._server: grpc.aio.Server | None = None
        self.admission = AdmissionQueue(config.grpc_max_concurrent_transfers, config.grpc_max_queued_transfers)
        self.unauthenticated = 0  # streams refused for a missing or wrong cluster secret (loop thread only)
        self.counts: Counter[str] = Counter()  # loop thread only
        self._idle_sessions: set[asyncio.Task] = set()  # session handlers between transfers (loop thread only)
        self._closing = False
        self.host = host
        self.port = self._loop.run(self._start(host, port), timeout=config.connect_timeout_s)

    async def _start(self, host: str, port: int) -> int:
        handler = grpc.stream_stream_rpc_method_handler(
            self._push, request_deserializer=None, response_serializer=tandem_pb2.KVAck.SerializeToString)
        # No maximum_concurrent_rpcs: gRPC would refuse calls past it; self.admission queues them instead.
        self._server = grpc.aio.server(options=channel_options(self.config.grpc_max_message_bytes))
        generic = grpc.method_handlers_generic_handler(SERVICE_NAME, {PUSH_METHOD: handler})
        self._server.add_generic_rpc_handlers((generic,))
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"could not bind the KV gRPC server to {host}:{port}")
        await self._server.start()
        return bound

    @property
    def address(self) -> ReceiverAddress:
        return ReceiverAddress("grpc", target=f"{self.host}:{self.port}")

    @property
    def dropped_connections(self) -> dict[str, int]:
        return {"unauthenticated": self.unauthenticated} if self.unauthenticated else {}

    async def _push(self, request_iterator, context) -> None:
        """A Push stream: refused UNAUTHENTICATED first (nothing read, nothing allocated, nothing in the inbox)
        without this cluster's secret; else the headers go out at once (a sender waits for them before its
        first write) and the stream carries a session or one transfer."""
        metadata = context.invocation_metadata()
        if not is_authorized(self.config.cluster_secret, metadata):
            self.unauthenticated += 1
            log.warning("refused a KV stream from %s: missing or wrong cluster secret", context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        if asks_for_session(metadata):
            await context.send_initial_metadata((SESSION_METADATA,))
            try:
                await self._session(context)
            except asyncio.CancelledError:  # the sender must see the stream end (PEER_FAILED), not reuse it
                context.set_code(grpc.StatusCode.UNAVAILABLE)
                context.set_details("the receiver ended the stream (closing, or its handler was cancelled)")
        else:
            await context.send_initial_metadata(())
            await self._one_push(context)

    async def _session(self, context) -> None:
        """Transfers one after another, each a manifest and its chunks in and one final ack out (no accept
        ack). Between transfers it waits for the next manifest without a deadline; the sender's half-close
        or cancel then ends it with no outcome. After a failed transfer (or a failed ack) it ends the stream:
        the sender opens another. Every transfer puts exactly one outcome in the inbox. The stream's trailing
        metadata says how many transfers it began."""
        task, began = asyncio.current_task(), [0]
        self.counts["sessions"] += 1
        try:
            await self._transfers(context, task, began)
        finally:
            context.set_trailing_metadata(((TRANSFERS_METADATA_KEY, str(began[0])),))

    async def _transfers(self, context, task: asyncio.Task, began: list[int]) -> None:
        """The session's loop: idle (listed in _idle_sessions, so close() can end it) until a manifest comes,
        then that transfer to its one outcome; began[0] counts the transfers begun."""
        while not self._closing:
            self._idle_sessions.add(task)
            try:
                raw = await context.read()
            except grpc.aio.AioRpcError:  # the stream broke between transfers: nothing under way
                return
            finally:
                self._idle_sessions.discard(task)
            if raw is grpc.aio.EOF:
                return
            began[0] += 1
            final, received, read_on = await self._run_transfer(context, raw)
            if not await self._finish(context, final, received) or final.status != tandem_pb2.KV_OK:
                if read_on:  # the sender drops the stream once it reads the failure
                    await self._drain_for(context)
                return

    async def _one_push(self, context) -> None:
        """One transfer on its own stream: manifest, admission (maybe a wait in the queue), allocate, the
        accept ack, the chunks until the client half-closes, verify, final ack. Whatever ends it (bad data,
        full queue, timeout, client gone, receiver cancel) frees the blocks first and puts exactly one outcome
        in the inbox; a delivery reaches the inbox only after its final ack went out."""
        final, received, read_on = await self._run_transfer(context)
        if await self._finish(context, final, received) and read_on:
            await self._drain_for(context)  # let a client that was still writing see the ack and half-close

    async def _finish(self, context, final: tandem_pb2.KVAck, received: ReceivedKV | None) -> bool:
        """Writes the final ack, then delivers `received` (a success). If the ack cannot be written, frees the
        received blocks and reports PEER_FAILED instead (a CancelledError is re-raised after). Returns
        whether the ack went out."""
        try:
            if received is not None and context.cancelled():  # the sender cancelled: nobody to deliver to
                raise KVTransferError(TransferStatus.PEER_FAILED, "the sender cancelled the stream",
                                      received.request_id)
            await self._write_final(context, final)
        except BaseException as exc:  # CancelledError too (the handler cancelled after commit): free, then end
            if received is not None:
                self.pool.free(received.block_ids)
                self.inbox.put(ReceiveFailed(received.request_id, TransferStatus.PEER_FAILED,
                                             f"could not ack: {exc!r}"))
            if isinstance(exc, asyncio.CancelledError):
                raise
            return False
        if received is not None:
            self.inbox.put(received)
        return True

    async def _write_final(self, context, final: tandem_pb2.KVAck) -> None:
        """Writes the final ack (a seam: tests fail or delay it)."""
        await context.write(final)
        self.counts["final"] += 1

    async def _drain_for(self, context) -> None:
        await drain(context, self.config.kv_transfer_timeout_s)

    async def _run_transfer(self, context,
                            raw: bytes | None = None) -> tuple[tandem_pb2.KVAck, ReceivedKV | None, bool]:
        """(final ack, the delivery if it succeeded, whether to drain the client's remaining writes). In a
        session `raw` is the transfer's first message, read already; else the manifest is read first. The
        transfer then waits for a slot in the admission queue (holding nothing) and allocates only once
        admitted. Each phase is bounded by kv_transfer_timeout_s."""
        held: list[IncomingTransfer] = []
        timeout_s, rid = self.config.kv_transfer_timeout_s, ""
        try:
            if raw is None:
                manifest = await asyncio.wait_for(self._read_manifest(context), timeout_s)
            else:
                manifest = decode_first(raw, self.pool.manifest_limits)
            rid = manifest.request_id
            await self.admission.enter(timeout_s, rid)
            try:
                with Deadline(timeout_s):
                    await self._receive(context, manifest, held, session=raw is not None)
                received = await self._commit(held[0])
            finally:
                self.admission.leave()
            return _ack(TransferStatus.OK, received.request_id, nbytes=received.kv_bytes), received, False
        except KVTransferError as exc:
            return self._failed(held, exc.status, exc.message, exc.request_id or rid), None, True
        except asyncio.TimeoutError:
            return self._failed(held, TransferStatus.TIMEOUT, f"not finished within {timeout_s}s", rid), None, False
        except asyncio.CancelledError:  # the client went away or cancelled; nobody to answer
            self._failed(held, TransferStatus.PEER_FAILED, "the sender disconnected or cancelled mid-transfer", rid)
            raise
        except Exception as exc:
            log.exception("kv push failed")
            return self._failed(held, TransferStatus.INTERNAL, f"{type(exc).__name__}: {exc}", rid), None, True

    async def _read_manifest(self, context) -> Manifest:
        """A lone Push's first chunk, decoded and checked against this pool's limits (sizes, layout) before
        anything is allocated; KVTransferError(MALFORMED / REJECTED_FINGERPRINT) if it is not acceptable."""
        return manifest_of(await next_chunk(context), self.pool.manifest_limits)

    async def _receive(self, context, manifest: Manifest, held: list[IncomingTransfer], session: bool) -> None:
        """Allocates the manifest's blocks (recorded in held), accepts it (a lone Push only: a session's sender
        does not wait for that), and lands every data chunk."""
        held.append(await self._accept_off_loop(manifest) if self.pool.allocation_waits else self._accept(manifest))
        if not session:
            await context.write(_ack(TransferStatus.OK, manifest.request_id, final=False))
            self.counts["verdict"] += 1
        await self._stream(context, held[0], session)

    async def _commit(self, incoming: IncomingTransfer) -> ReceivedKV:
        """Verify + scatter: on this thread for a small transfer (its runs landed here already), else off the
        event loop. If the call dies meanwhile, a late success's blocks are freed."""
        if self._lands_inline(incoming.manifest):
            return incoming.commit()
        return await off_loop(incoming.commit, lambda received: self.pool.free(received.block_ids))

    def _failed(self, held: list[IncomingTransfer], status: TransferStatus, message: str,
                request_id: str = "") -> tandem_pb2.KVAck:
        """Frees whatever the transfer holds, reports it in the inbox, and builds the error ack."""
        if held:
            outcome = held[0].fail(status, message)
            nbytes = held[0].bytes_written
        else:
            outcome, nbytes = ReceiveFailed(request_id, status, message), 0
        self.inbox.put(outcome)
        return _ack(status, outcome.request_id, message, nbytes)

    def _lands_inline(self, manifest: Manifest) -> bool:
        """A small transfer into a CPU pool lands on the loop thread (no hop to the lander and back)."""
        return is_small(self.pool, manifest.total_nbytes, manifest.streamed)

    def _accept(self, manifest: Manifest) -> IncomingTransfer:
        """Checks the cancel list and the fingerprint, then allocates (KVTransferError if any says no)."""
        if self.inbox.is_cancelled(manifest.request_id):
            raise KVTransferError(TransferStatus.CANCELLED, "cancelled by the receiver", manifest.request_id)
        lander = None if self._lands_inline(manifest) else self._lander
        return IncomingTransfer.accept(manifest, self.pool, self.staging, lander, trailing_checksums=True,
                                       host_reads=True)

    async def _accept_off_loop(self, manifest: Manifest) -> IncomingTransfer:
        """_accept on an executor thread, for a pool whose allocation may wait (a lane follower's, for rank 0's
        Expect): the loop serves the other transfers meanwhile. If the call dies meanwhile (its end is reported
        then), a late accept's blocks are freed."""
        return await off_loop(lambda: self._accept(manifest), lambda incoming: incoming.fail(
            TransferStatus.PEER_FAILED, "the call ended while its blocks were taken"))

    async def _stream(self, context, incoming: IncomingTransfer, session: bool) -> None:
        """Lands data chunks and trailing run checksums (and a layer-streamed transfer's tail): in a session
        until the transfer's last message is in, else until the client half-closes."""
        rid = incoming.manifest.request_id
        while not (session and arrived(incoming)):
            chunk = await next_chunk(context)
            if chunk is None:
                break
            if self.inbox.is_cancelled(rid):
                raise KVTransferError(TransferStatus.CANCELLED, "cancelled by the receiver", rid)
            land_chunk(incoming, chunk)
        if not incoming.complete:
            if session:  # a session's sender never half-closes mid-transfer: its stream was cancelled or broke
                raise KVTransferError(TransferStatus.PEER_FAILED, f"the stream ended after {incoming.bytes_written} "
                                      f"of {incoming.manifest.total_nbytes} bytes", rid)
            await asyncio.sleep(0.05)  # a lost client shows up as EOF first, as a cancelled call a moment later
            if context.done():
                raise KVTransferError(TransferStatus.PEER_FAILED, f"the sender went away after {incoming.bytes_written}"
                                      f" of {incoming.manifest.total_nbytes} bytes", rid)

    def close(self) -> None:
        """Ends the sessions waiting for their next transfer, then stops the server, letting transfers in flight
        finish within the transfer timeout."""
        if self._server is not None:
            timeout_s = self.config.kv_transfer_timeout_s
            self._loop.run(self._stop(timeout_s), timeout=timeout_s + 10)
            self._server = None
        self._loop.stop()
        self._lander.shutdown(wait=True)

    async def _stop(self, grace_s: float) -> None:
        self._closing = True
        for task in list(self._idle_sessions):
            task.cancel()
        await self._server.stop(grace=grace_s)
