"""The standard gRPC services for operators beside `tandem.v1.Tandem`: health and server reflection.

Both come from the package registry (grpcio-health-checking, grpcio-reflection), so every standard tool
talks to them: `grpcurl -plaintext HOST:PORT list` (reflection: no proto file needed),
`grpc_health_probe -addr HOST:PORT`, Kubernetes' gRPC probes. Neither needs the API key.

`grpc.health.v1.Health` follows the backend: a HealthFollower task on the server's loop reads
Backend.health() every `poll_s` and sets the status of "" (the server) and of "tandem.v1.Tandem" to SERVING
while the backend serves (degraded included: lost workers, the survivors serving) and NOT_SERVING when it
does not (no prefill or no decode worker left, the server stopping, the backend shut down, or health()
failing or taking longer than HEALTH_TIMEOUT_S). The task ends when the server stops.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.backend import Backend
from proto import tandem_pb2

logger = logging.getLogger("tandem.cluster.grpc")
TANDEM_SERVICE = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name   # "tandem.v1.Tandem"
HEALTH_TIMEOUT_S = 10.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthFollower:
    """Publishes `backend`'s health to a grpc.health.v1 servicer; see the module docstring."""

    def __init__(self, backend: Backend, poll_s: float) -> None:
        self.servicer = health.aio.HealthServicer()
        self._backend, self._poll_s = backend, poll_s
        self._status: int | None = None
        self._task: asyncio.Task | None = None

    async def publish(self) -> None:
        """Reads the backend's health once and sets the services' status from it."""
        reason = ""
        try:
            backend_health = await asyncio.wait_for(self._backend.health(), HEALTH_TIMEOUT_S)
            status = SERVING if backend_health.serving else NOT_SERVING
            lost = backend_health.details.get("worker_failures") or {}
            reason = f"; lost workers: {', '.join(sorted(lost))}" if lost else ""
        except Exception as error:  # a health check that fails says: not serving
            status, reason = NOT_SERVING, f"; health check failed: {type(error).__name__}"
        if status != self._status:
            logger.log(logging.INFO if status == SERVING else logging.WARNING, "gRPC health: %s%s",
                       health_pb2.HealthCheckResponse.ServingStatus.Name(status), reason)
            self._status = status
        for service in ("", TANDEM_SERVICE):
            await self.servicer.set(service, status)

    def follow(self, server: grpc.aio.Server, on_stop: Callable[[], None] | None = None) -> None:
        """Starts the task that publishes every poll_s until `server` stops, then calls `on_stop` (call once the
        server started)."""
        self._task = asyncio.ensure_future(self._follow(server, on_stop))

    async def _follow(self, server: grpc.aio.Server, on_stop: Callable[[], None] | None) -> None:
        try:
            while await server.wait_for_termination(timeout=self._poll_s):  # True: timed out, still running
                await self.publish()
        finally:
            if on_stop is not None:
                on_stop()


async def add_operator_services(server: grpc.aio.Server, backend: Backend, poll_s: float) -> HealthFollower:
    """Adds health (its status already set from the backend) and reflection of every service on `server`,
    before it starts; returns the follower, to `follow(server)` once it did."""
    follower = HealthFollower(backend, poll_s)
    await follower.publish()
    health_pb2_grpc.add_HealthServicer_to_server(follower.servicer, server)
    reflection.enable_server_reflection((TANDEM_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return follower
