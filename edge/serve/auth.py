"""API keys for `edge serve`: with a credentials file (the format `hybridspec token add` writes, shared
with the cloud), every /v1/ request needs `Authorization: Bearer KEY` naming one of its identities;
401 in OpenAI's shape otherwise. Health and metrics stay open (bind them to a private network or put
them behind the load balancer's own rules)."""
from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from ...common.security.credentials import CredentialStore, bearer
from ...common.protocol.errors import Unauthenticated
from .errors import APIError

PROTECTED_PREFIX = "/v1/"


class APIKeys:
    """ASGI middleware: checks the bearer key of every request under /v1/ before the app sees it; the
    identity it names is put in scope["state"]["identity"]."""

    def __init__(self, app: ASGIApp, store: CredentialStore) -> None:
        self.app = app
        self.store = store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        try:
            identity = self.store.identify(bearer(header))
        except Unauthenticated as exc:
            error = APIError(401, f"{exc} (send Authorization: Bearer YOUR_KEY)", code="invalid_api_key")
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": json.dumps(error.body()).encode()})
            return
        scope.setdefault("state", {})["identity"] = identity
        await self.app(scope, receive, send)
