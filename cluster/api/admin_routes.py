"""The admin routes of the HTTP front end: the worker set, read and changed while serving.

    GET  /admin/workers                                   -> {"workers": {name: {role, state}}, "bounds": ...}
    POST /admin/workers {"role": "decode", "delta": 1}    -> 200 once the new worker serves
    POST /admin/workers {"role": "decode", "delta": -1}   -> 200 once it drains (it stops when its requests end)

Behind the API key like every route but the probes (http_server.py checks it first: 401). A body that is
not {"role": str, "delta": int} with nothing else, a role the cluster does not have, a delta of 0, or a
change past the bounds (--min-*/--max-* or the cluster's resources): 400 naming the field, and nothing
changes; a worker that does not start: 503, nothing changes. The change itself is the backend's
(cluster.backend.WorkerScaling: the coordinator's Scaling); a server with one engine in its process has
no workers to change: 400.
"""
from __future__ import annotations

from aiohttp import web

from cluster.api.input_pool import InputPool
from cluster.api.openai_protocol import OpenAIError, bad_request, parse_json_body
from cluster.backend import BackendUnavailable, ScaleRefused, WorkerScaling

ADMIN_WORKERS = "/admin/workers"
FIELDS = ("role", "delta")


class AdminRoutes:
    """/admin/workers over `scaling` (None: a backend without workers); a large body is parsed on `inputs`."""

    def __init__(self, scaling: WorkerScaling | None, inputs: InputPool) -> None:
        self._scaling, self._inputs = scaling, inputs

    def add_to(self, app: web.Application, expect_handler=None) -> None:
        """Adds the routes to `app`, each with `expect_handler` (None: aiohttp's)."""
        app.router.add_get(ADMIN_WORKERS, self.workers, expect_handler=expect_handler)
        app.router.add_post(ADMIN_WORKERS, self.scale, expect_handler=expect_handler)

    async def workers(self, request: web.Request) -> web.Response:
        return web.json_response(self._backend_scaling().describe())

    async def scale(self, request: web.Request) -> web.Response:
        scaling = self._backend_scaling()
        raw = await request.read()
        body = await self._inputs.prepare(len(raw), lambda: parse_json_body(raw))
        role, delta = parse_scale_body(body, scaling.roles)
        try:
            return web.json_response(await scaling.scale(role, delta))
        except ScaleRefused as refused:
            raise bad_request(str(refused), param=refused.field) from refused
        except BackendUnavailable as error:
            raise OpenAIError(503, str(error), type="service_unavailable", code="backend_unavailable") from error

    def _backend_scaling(self) -> WorkerScaling:
        if self._scaling is None:
            raise bad_request("this server runs one engine in its own process: it has no workers to add or "
                              "drain (serve with --replicas N, or disaggregated)", param="role")
        return self._scaling


def parse_scale_body(body: dict, roles: tuple[str, ...]) -> tuple[str, int]:
    """(role, delta) of a POST /admin/workers body; 400 naming the field for anything else."""
    for key in body:
        if key not in FIELDS:
            raise bad_request(f"unknown field {key!r}: a change of the worker set takes {list(FIELDS)}", param=key)
    role, delta = body.get("role"), body.get("delta")
    if not isinstance(role, str) or role not in roles:
        raise bad_request(f"role must be one of {list(roles)} in this cluster, got {role!r}", param="role")
    if isinstance(delta, bool) or not isinstance(delta, int) or delta == 0:
        raise bad_request(f"delta must be a non-zero integer (+k adds k workers, -k drains k), got {delta!r}",
                          param="delta")
    return role, delta
