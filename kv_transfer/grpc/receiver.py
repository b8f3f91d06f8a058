"""KVReceiver serving the gRPC KVTransfer.Push stream (asyncio gRPC server on its own loop thread)."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from kv_transfer.config import ReceiverAddress, TransferConfig
from kv_transfer.connector import KVReceiver
from kv_transfer.grpc.admission import AdmissionQueue
from kv_transfer.grpc.auth import REFUSAL, is_authorized
from kv_transfer.grpc.codec import PUSH_METHOD, SERVICE_NAME, DecodedChunk, channel_options, decode_chunk
from kv_transfer.grpc.heap import keep_heap_for_messages
from kv_transfer.grpc.loop_thread import EventLoopThread
from kv_transfer.incoming import IncomingTransfer
from kv_transfer.manifest import Manifest, ManifestError
from kv_transfer.manifest_decode import decode_manifest
from kv_transfer.pool import KVPoolView
from kv_transfer.results import ReceivedKV, ReceiveFailed, ReceiveInbox
from kv_transfer.staging import StagingPool
from kv_transfer.status import KVTransferError, TransferStatus
from proto import tandem_pb2

log = logging.getLogger(__name__)


def _ack(status: TransferStatus, request_id: str = "", error: str = "", nbytes: int = 0, final: bool = True) -> tandem_pb2.KVAck:
    return tandem_pb2.KVAck(status=int(status), request_id=request_id, error=error, bytes_received=nbytes, final=final)


class GrpcReceiver(KVReceiver):
    """Binds host:port (port 0 picks a free one) and accepts Push streams into the pool: up to
    config.grpc_max_concurrent_transfers at once, up to config.grpc_max_queued_transfers more waiting in
    arrival order (their manifests read, nothing allocated), any further one rejected (REJECTED_BUSY).
    With config.cluster_secret, a stream without it is ended UNAUTHENTICATED before anything is read
    (counted in `unauthenticated`, nothing in the inbox)."""

    def __init__(self, config: TransferConfig, pool: KVPoolView, host: str = "127.0.0.1", port: int = 0):
        self.config, self.pool = config, pool
        self.inbox = ReceiveInbox(config.cancel_ttl_s)
        if config.grpc_keep_heap:
            keep_heap_for_messages(config.grpc_chunk_bytes)
        self.staging = StagingPool("cpu", pin_memory=pool.device.type == "cuda", max_cached_bytes=config.staging_cache_bytes)
        self._loop = EventLoopThread("kv-grpc-recv")
        self._lander = ThreadPoolExecutor(1, thread_name_prefix="kv-grpc-land")
        self._server: grpc.aio.Server | None = None
        self.admission = AdmissionQueue(config.grpc_max_concurrent_transfers, config.grpc_max_queued_transfers)
        self.unauthenticated = 0  # streams refused for a missing or wrong cluster secret (loop thread only)
        self.host = host
        self.port = self._loop.run(self._start(host, port), timeout=config.connect_timeout_s)

    async def _start(self, host: str, port: int) -> int:
        handler = grpc.stream_stream_rpc_method_handler(
            self._push, request_deserializer=None, response_serializer=tandem_pb2.KVAck.SerializeToString)
        # No maximum_concurrent_rpcs: gRPC would refuse calls past it; self.admission queues them instead.
        self._server = grpc.aio.server(options=channel_options(self.config.grpc_max_message_bytes))
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {PUSH_METHOD: handler}),))
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
        """One transfer: manifest, admission (maybe a wait in the queue), allocate, stream into the blocks or
        staging, verify (+ scatter), final ack. Whatever ends it (bad data, full queue, timeout, client gone,
        receiver cancel) frees the blocks first and puts exactly one outcome in the inbox; a delivery reaches
        the inbox only after its final ack went out. A stream without this cluster's secret is ended with
        UNAUTHENTICATED first: nothing read, nothing allocated, nothing in the inbox."""
        if not is_authorized(self.config.cluster_secret, context.invocation_metadata()):
            self.unauthenticated += 1
            log.warning("refused a KV stream from %s: missing or wrong cluster secret", context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        await context.send_initial_metadata(())  # at once: a sender may wait for it before its first write
        final, received, drain = await self._run_transfer(context)
        try:
            await self._write_final(context, final)
        except BaseException as exc:  # CancelledError too (the handler cancelled after commit): free, then end
            if received is not None:
                self.pool.free(received.block_ids)
                self.inbox.put(ReceiveFailed(received.request_id, TransferStatus.PEER_FAILED,
                                             f"could not ack: {exc!r}"))
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        if received is not None:
            self.inbox.put(received)
        if drain:  # let a client that was still writing see the ack and half-close
            try:
                await asyncio.wait_for(self._drain(context), self.config.kv_transfer_timeout_s)
            except (asyncio.TimeoutError, grpc.aio.AioRpcError):
                pass

    async def _write_final(self, context, final: tandem_pb2.KVAck) -> None:
        """Writes the final ack (a seam: tests cancel the call right after it)."""
        await context.write(final)

    async def _run_transfer(self, context) -> tuple[tandem_pb2.KVAck, ReceivedKV | None, bool]:
        """(final ack, the delivery if it succeeded, whether to drain the client's remaining writes).
        The manifest is read first; the transfer then waits for a slot in the admission queue (holding
        nothing) and allocates only once admitted. Each phase is bounded by kv_transfer_timeout_s."""
        held: list[IncomingTransfer] = []
        timeout_s, rid = self.config.kv_transfer_timeout_s, ""
        try:
            manifest = await asyncio.wait_for(self._read_manifest(context), timeout_s)
            rid = manifest.request_id
            await self.admission.enter(timeout_s, rid)
            try:
                await asyncio.wait_for(self._receive(context, manifest, held), timeout_s)
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

    async def _receive(self, context, manifest: Manifest, held: list[IncomingTransfer]) -> None:
        """Allocates the manifest's blocks (recorded in held), accepts it, and lands every data chunk."""
        held.append(self._accept(manifest))
        await context.write(_ack(TransferStatus.OK, manifest.request_id, final=False))
        await self._stream(context, held[0])

    async def _drain(self, context) -> None:
        while await context.read() is not grpc.aio.EOF:
            pass

    async def _commit(self, incoming: IncomingTransfer) -> ReceivedKV:
        """Verify + scatter off the event loop. If the call dies meanwhile, a late success is undone."""
        future = asyncio.get_running_loop().run_in_executor(None, incoming.commit)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._undo_late_commit)
            raise

    def _undo_late_commit(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.pool.free(future.result().block_ids)

    def _failed(self, held: list[IncomingTransfer], status: TransferStatus, message: str, request_id: str = "") -> tandem_pb2.KVAck:
        """Frees whatever the transfer holds, reports it in the inbox, and builds the error ack."""
        if held:
            outcome = held[0].fail(status, message)
            nbytes = held[0].bytes_written
        else:
            outcome, nbytes = ReceiveFailed(request_id, status, message), 0
        self.inbox.put(outcome)
        return _ack(status, outcome.request_id, message, nbytes)

    async def _read_manifest(self, context) -> Manifest:
        """The stream's first chunk, decoded and checked against this pool's limits (sizes, layout) before
        anything is allocated; KVTransferError(MALFORMED / REJECTED_FINGERPRINT) if it is not acceptable."""
        first = await self._next_chunk(context)
        if first is None or first.manifest is None:
            raise KVTransferError(TransferStatus.MALFORMED, "the first chunk must carry the manifest")
        try:
            return decode_manifest(first.manifest, self.pool.manifest_limits)
        except ManifestError as exc:  # MALFORMED, or REJECTED_FINGERPRINT
            raise KVTransferError(exc.status, str(exc)) from None

    def _accept(self, manifest: Manifest) -> IncomingTransfer:
        """Checks the cancel list and the fingerprint, then allocates (KVTransferError if any says no)."""
        if self.inbox.is_cancelled(manifest.request_id):
            raise KVTransferError(TransferStatus.CANCELLED, "cancelled by the receiver", manifest.request_id)
        return IncomingTransfer.accept(manifest, self.pool, self.staging, self._lander, trailing_checksums=True)

    async def _stream(self, context, incoming: IncomingTransfer) -> None:
        """Lands data chunks and trailing run checksums (and a layer-streamed transfer's tail) until the client
        half-closes (see IncomingTransfer.write, run_checksum and set_tail)."""
        rid = incoming.manifest.request_id
        while (chunk := await self._next_chunk(context)) is not None:
            if self.inbox.is_cancelled(rid):
                raise KVTransferError(TransferStatus.CANCELLED, "cancelled by the receiver", rid)
            if chunk.data is not None:
                incoming.write(chunk.data)
            elif chunk.run_checksum is not None:
                incoming.run_checksum(chunk.run_checksum)
            elif chunk.tail is not None:
                incoming.set_tail(chunk.tail)
            else:
                raise KVTransferError(TransferStatus.MALFORMED, "a chunk after the first must carry data, a run "
                                      "checksum or a tail", rid)
        if not incoming.complete:
            await asyncio.sleep(0.05)  # a lost client shows up as EOF first, as a cancelled call a moment later
            if context.done():
                raise KVTransferError(TransferStatus.PEER_FAILED, f"the sender went away after {incoming.bytes_written}"
                                      f" of {incoming.manifest.total_nbytes} bytes", rid)

    @staticmethod
    async def _next_chunk(context) -> DecodedChunk | None:
        """The next chunk of the stream, None at its end."""
        try:
            raw = await context.read()
        except grpc.aio.AioRpcError as exc:
            raise KVTransferError(TransferStatus.PEER_FAILED, f"stream broke: {exc.code().name}") from None
        if raw is grpc.aio.EOF:
            return None
        try:
            return decode_chunk(raw)
        except ValueError as exc:
            raise KVTransferError(TransferStatus.MALFORMED, str(exc)) from None

    def close(self) -> None:
        """Stops the server, letting transfers in flight finish within the transfer timeout."""
        if self._server is not None:
            self._loop.run(self._server.stop(grace=self.config.kv_transfer_timeout_s), timeout=self.config.kv_transfer_timeout_s + 10)
            self._server = None
        self._loop.stop()
        self._lander.shutdown(wait=True)
