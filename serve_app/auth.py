"""API keys: with any set, a request must carry one as `Authorization: Bearer KEY`, or it is a 401.

Owns which keys an ingress replica takes (the config's `api_keys` and the RWKV_FLEET_API_KEY
environment variable), which paths are open without one, and the refusal's OpenAI error JSON. A
pure ASGI middleware in front of every route: it answers a refusal itself and passes every other
request through untouched (a streamed reply and its client's leaving included). Never touches
generation.

Serve runs each ingress replica in a process of its own, and builds the middleware from the
pickled FastAPI app, before the replica's __init__ has its config: so the keys live in this
module (`KEYS`), set once by the replica as it starts.
"""

from __future__ import annotations

import hmac
import os

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .protocol import ApiError

ENV_VAR = "RWKV_FLEET_API_KEY"

# open without a key: liveness for load balancers, Prometheus' scrape (figures, no text), the API's schema
OPEN_PATHS = frozenset({"/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


class ApiKeys:
    """The keys this process's ingress accepts; none: every request is let in."""

    def __init__(self) -> None:
        self._keys: tuple[bytes, ...] = ()

    def set(self, keys: list[str]) -> None:
        """These keys, and RWKV_FLEET_API_KEY's where the environment has it."""
        env = os.environ.get(ENV_VAR, "").strip()
        self._keys = tuple(dict.fromkeys(k.encode() for k in [*keys, env] if k))

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def refusal(self, authorization: bytes | None) -> ApiError | None:
        """Why a request with this Authorization header is refused, or None when it may pass."""
        if not self._keys:
            return None
        scheme, _, key = (authorization or b"").strip().partition(b" ")
        if scheme.lower() != b"bearer" or not key.strip():
            return ApiError(401, "no API key: send one as the header Authorization: Bearer KEY",
                            code="invalid_api_key")
        key = key.strip()
        # every key compared, each in constant time: the answer's timing tells nothing of the keys
        if not sum(hmac.compare_digest(key, k) for k in self._keys):
            return ApiError(401, "the API key is not one of this server's", code="invalid_api_key")
        return None


KEYS = ApiKeys()


class ApiKeyGate:
    """The ASGI middleware: refuses a request to a path outside OPEN_PATHS without a valid key."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and KEYS.required and _route(scope) not in OPEN_PATHS:
            error = KEYS.refusal(dict(scope["headers"]).get(b"authorization"))
            if error is not None:
                response = JSONResponse(error.body(), status_code=error.status,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _route(scope: Scope) -> str:
    """The path as the routes see it (without the application's route prefix, where Starlette keeps it)."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path
