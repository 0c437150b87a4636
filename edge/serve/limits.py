"""How much work the server takes on: a bounded number of generations (running plus waiting; beyond
that a 429 at once, rather than a queue that grows until every client times out) and a bounded
request body (413 before anything is parsed)."""
from __future__ import annotations

import json

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError


class Admission:
    """Generation slots: `max_concurrent` run at once on worker threads, `max_queued` more wait."""

    def __init__(self, max_concurrent: int, max_queued: int) -> None:
        self.limiter = anyio.CapacityLimiter(max_concurrent)  # the worker threads generations run on
        self.capacity = max_concurrent + max_queued
        self.admitted = 0  # running or waiting for a thread; touched on the event loop only

    def admit(self) -> None:
        """Take a slot, or raise the 429."""
        if self.admitted >= self.capacity:
            raise APIError(429, f"the server is at its limit of {self.capacity} concurrent generation requests "
                                "(max_concurrent + max_queued); retry later", code="too_many_requests")
        self.admitted += 1

    def release(self) -> None:
        """Give a slot back once its generation's thread is done."""
        self.admitted -= 1


DRAIN_FACTOR = 4  # an oversized body is read (and dropped) up to this many times the limit before the 413


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413, whether it declares its length or
    not. The body is read up front and replayed to the app, then `receive` passes on, so the app
    still hears about a client that disconnects."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(receive, send, 0)
        size, messages = 0, []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._too_large(receive if message.get("more_body") else None, send, size)
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, receive: Receive | None, send: Send, read: int) -> None:
        """Answer 413. The rest of the body is read and dropped first, up to DRAIN_FACTOR × the limit:
        closing a connection with unread data makes the kernel reset it, and the client may lose
        the answer to the reset. A body larger still is cut off all the same."""
        while receive is not None and read <= DRAIN_FACTOR * self.max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                break
            read += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        error = APIError(413, f"the request body is larger than {self.max_bytes} bytes (--max-body-bytes)",
                         code="request_too_large")
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": json.dumps(error.body()).encode()})
