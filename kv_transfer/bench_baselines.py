"""The baselines `kv_transfer.bench` times beside each transfer: a raw loopback socket, and for gRPC its floor.

The raw socket: the same number of bytes over a plain TCP socket on 127.0.0.1 (sendall -> recv_into a
preallocated buffer -> 1-byte ack). The gRPC floor: the same bytes on a bare grpc-python stream, what
grpc-python itself costs for a transfer's messages with no KV work at all: one long-lived stream
(as the transport's sessions keep), per transfer a small header message, then the bytes in messages of the
transport's chunk size, then a one-byte reply; the receiver copies each message into one preallocated
buffer (as the transport lands chunks in its pool). Both ends run grpc.aio on an event-loop thread of their
own, with the transport's channel options, so the ratio "transfer / floor" is what Tandem adds on top of
gRPC and "floor / raw socket" is what gRPC itself costs.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc

from kv_transfer.grpc.codec import channel_options
from kv_transfer.grpc.loop_thread import EventLoopThread



class TcpSink:
    """Receives raw-socket payloads into one preallocated buffer and acks each with one byte."""

    def __init__(self, max_bytes: int):
        self.buffer = memoryview(bytearray(b"\x01" * max_bytes))  # resident pages, like the pools
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]

    def receive(self, nbytes: int) -> threading.Thread:
        """Accepts one connection on a new thread and takes nbytes from it; join the thread for the end."""
        def serve():
            conn, _ = self.listener.accept()
            with conn:
                got = 0
                while got < nbytes:
                    got += conn.recv_into(self.buffer[got:nbytes], nbytes - got)
                conn.sendall(b"k")
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.listener.close()


def tcp_send(port: int, payload: memoryview) -> float:
    """Sends payload to a TcpSink's port on a fresh connection; the seconds from the first byte to the ack."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.perf_counter()
        conn.sendall(payload)
        conn.recv(1)
        return time.perf_counter() - started


_PATH = "/tandem.bench.Floor/Push"  # a method of this benchmark only: never served by Tandem
_SERVICE, _METHOD = _PATH.strip("/").split("/")
_HEADER_BYTES = 8  # little-endian uint64: the transfer's size


class GrpcFloorSink:
    """A bare grpc.aio server (127.0.0.1, a free port) that takes transfers into one buffer."""

    def __init__(self, max_bytes: int, max_message_bytes: int):
        self.buffer = memoryview(bytearray(b"\x01" * max_bytes))  # resident pages, like the pools
        self._options = channel_options(max_message_bytes)
        self._loop = EventLoopThread("bench-grpc-floor-sink")
        self._server = None
        self.port = self._loop.run(self._start(), timeout=30)

    async def _start(self) -> int:
        handler = grpc.stream_stream_rpc_method_handler(self._push)  # bytes in, bytes out: no (de)serializer
        self._server = grpc.aio.server(options=self._options)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {_METHOD: handler}),))
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return port

    async def _push(self, messages, context):
        """Per transfer: a header, then messages whose bytes are copied in order into the buffer; one reply."""
        expected, got = None, 0
        async for message in messages:
            if expected is None:
                expected, got = int.from_bytes(message, "little"), 0
                continue
            self.buffer[got : got + len(message)] = message
            got += len(message)
            if got >= expected:
                expected = None
                yield b"k"

    def close(self) -> None:
        if self._server is not None:
            self._loop.run(self._server.stop(None), timeout=10)
        self._loop.stop()


class GrpcFloorClient:
    """The sending end: one stream, opened at the first transfer and kept."""

    def __init__(self, port: int, max_message_bytes: int):
        self._loop = EventLoopThread("bench-grpc-floor-client")
        self._options = channel_options(max_message_bytes)
        self._port = port
        self._channel = None
        self._call = None

    def send(self, payload: memoryview, chunk_bytes: int) -> float:
        """Sends payload (flat bytes) as one transfer; returns the seconds from the header to the reply."""
        return self._loop.run(self._send(payload, chunk_bytes), timeout=120)

    async def _send(self, payload: memoryview, chunk_bytes: int) -> float:
        if self._call is None:
            self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{self._port}", options=self._options)
            self._call = self._channel.stream_stream(_PATH)()
        started = time.perf_counter()
        await self._call.write(payload.nbytes.to_bytes(_HEADER_BYTES, "little"))
        for offset in range(0, payload.nbytes, chunk_bytes):
            await self._call.write(bytes(payload[offset : offset + chunk_bytes]))  # one copy, as a data chunk's
        await self._call.read()
        return time.perf_counter() - started

    def close(self) -> None:
        if self._call is not None:
            self._loop.run(self._close(), timeout=10)
        self._loop.stop()

    async def _close(self) -> None:
        await self._call.done_writing()
        await asyncio.wait_for(self._call.code(), 5)
        await self._channel.close()
