"""Who may call the API: API keys, and the browser origins allowed to call it (CORS).

Owns which keys an ingress replica takes (the config's `api_keys` and the RWKV_FLEET_API_KEY
environment variable), which paths are open without one, the refusal's OpenAI error JSON (401),
and the origins whose pages may call the API from a browser (`cors_allow_origins`: Starlette's
CORSMiddleware, which answers a preflight itself, before any key is asked for, as browsers send
none with it). One pure ASGI middleware in front of every route: it answers a refusal itself and
passes every other request through untouched (a streamed reply and its client's leaving
included). Never touches generation.

Serve runs each ingress replica in a process of its own, and builds the middleware from the
pickled FastAPI app, before the replica's __init__ has its config: so the settings live in this
module (`ACCESS`), set once by the replica as it starts.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence

from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .protocol import ApiError

ENV_VAR = "RWKV_FLEET_API_KEY"

# open without a key: liveness for load balancers, Prometheus' scrape (figures, no text), the API's schema
OPEN_PATHS = frozenset({"/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


class Access:
    """This process's ingress settings: the keys it accepts (none: every request is let in) and the
    browser origins it allows (none: no CORS headers, so browsers keep other origins' pages out)."""

    def __init__(self) -> None:
        self._keys: tuple[bytes, ...] = ()
        self.origins: tuple[str, ...] = ()

    def set(self, keys: Sequence[str], origins: Sequence[str] = ()) -> None:
        """These keys, and RWKV_FLEET_API_KEY's where the environment has it; these origins."""
        env = os.environ.get(ENV_VAR, "").strip()
        self._keys = tuple(dict.fromkeys(k.encode() for k in [*keys, env] if k))
        self.origins = tuple(origins)

    @property
    def keyed(self) -> bool:
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


ACCESS = Access()


class AccessGate:
    """The ASGI middleware: CORS where origins are allowed, then the key check for every path
    outside OPEN_PATHS."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._cors: CORSMiddleware | None = None  # made at the first request, once the settings are in

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if ACCESS.origins and self._cors is None:
            self._cors = CORSMiddleware(self._keyed, allow_origins=list(ACCESS.origins), allow_methods=["*"],
                                        allow_headers=["*"], expose_headers=["Retry-After"], max_age=600)
        await (self._cors or self._keyed)(scope, receive, send)

    async def _keyed(self, scope: Scope, receive: Receive, send: Send) -> None:
        if ACCESS.keyed and _route(scope) not in OPEN_PATHS:
            error = ACCESS.refusal(dict(scope["headers"]).get(b"authorization"))
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
