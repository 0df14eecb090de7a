"""`enable_metrics`: the gateway's Prometheus metrics on a port of their own (`metrics_port`), as the
seed's monitoring configuration names it. GET (or HEAD) /metrics only, the same exposition as the HTTP
API's /metrics (an API key too when `serving.metrics_require_key`); any other path is a 404, any other
method a 405. The HTTP API's own /metrics stays."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from starlette.responses import JSONResponse

from gateway.openai.app import HttpApi, error_body, error_response
from hetero_common.errors import HeteroError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class MetricsOnlyApp:
    """An ASGI app answering /metrics through `api` (its metrics and its API keys)."""

    def __init__(self, api: HttpApi) -> None:
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off; websockets are refused by the server
            return
        if scope["path"] != "/metrics":
            response = JSONResponse(error_body(404, f"{scope['path']} is not served on metrics_port: only "
                                                    "GET /metrics"), status_code=404)
        elif scope["method"] not in ("GET", "HEAD"):
            response = JSONResponse(error_body(405, f"{scope['method']} /metrics: use GET"), status_code=405,
                                    headers={"allow": "GET, HEAD"})
        else:
            response = await self._metrics(scope)
        await response(scope, receive, send)

    async def _metrics(self, scope: Scope) -> Any:
        if self.api.serving.metrics_require_key:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            try:
                self.api.keys.check(headers.get("authorization"))
            except HeteroError as exc:
                return error_response(exc)
        return await self.api.metrics()
