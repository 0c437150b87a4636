"""The front door's session table: which ids it issued, which replica holds each, and whose it is.

Session ids are issued here, 144 random bits each, so they cannot be guessed: presenting an id is
proof of holding the session, and only its holder can verify, re-open or close it. An OpenSession
naming a live id re-opens that session in place; any other id (unknown, expired, or made up) starts
a new session under a fresh id, so no client can choose, squat or take over another's id.

Every client may hold at most `max_per_client` sessions (or its identity's own `max_sessions`), so
one client cannot take every slot. A client is an identity from the credentials file, or, on a server
without one, a peer address: every caller from that address shares its `max_per_address` sessions
(on one host, all local processes are 127.0.0.1), a limit set apart from the per-token one. With credentials a session also belongs to the identity that opened it:
any other identity presenting its id gets PERMISSION_DENIED. The table is reconciled with what the
replicas report they hold, so sessions a replica expired do not linger here.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from ...common.security.credentials import Identity
from ...common.protocol.errors import FailedPrecondition, PermissionDenied, ResourceExhausted


def new_session_id() -> str:
    """24 URL-safe characters carrying 144 random bits."""
    return secrets.token_urlsafe(18)


@dataclass
class Route:
    """Where one session lives and who opened it."""

    replica: str  # the replica holding its KV cache; "" while a new session is being placed
    client: str  # the name of the identity that opened it (counts towards that identity's limit)
    opening: bool = True  # an OpenSession is in flight: the replica may not list it yet
    routed_at: float = field(default_factory=time.monotonic)


class SessionTable:
    """Session id -> Route, with per-client limits."""

    def __init__(self, max_per_client: int, max_per_address: int) -> None:
        """max_per_client: per token identity without a limit of its own; max_per_address: per peer
        address, for callers without a token."""
        if max_per_client < 1 or max_per_address < 1:
            raise ValueError(f"max_per_client and max_per_address must be >= 1, got {max_per_client}, "
                             f"{max_per_address}")
        self.max_per_client = max_per_client
        self.max_per_address = max_per_address
        self._routes: dict[str, Route] = {}
        self._per_client: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._routes)

    def get(self, session_id: str, owner: str = "") -> Route:
        """The route of a live session; FailedPrecondition (without echoing the id) otherwise, and
        PermissionDenied if `owner` (an authenticated caller's `Identity.owner`; "" for anyone else)
        is not the identity that opened it."""
        route = self._routes.get(session_id)
        if route is None:
            raise FailedPrecondition("the session is unknown or was evicted; re-open it")
        _check_owner(route, owner)
        return route

    def lookup(self, session_id: str) -> Route | None:
        """The route of a session, or None."""
        return self._routes.get(session_id)

    def claim(self, requested_id: str, caller: Identity) -> tuple[str, Route]:
        """The id and route an OpenSession will use: the requested id's if it is live (a re-open, by
        its owner only), else a fresh id for `caller`, counted from now on and not yet on any replica
        (route.replica is "" until the caller places it). ResourceExhausted when the caller has no
        room left; PermissionDenied when the live id is another identity's."""
        route = self._routes.get(requested_id) if requested_id else None
        if route is not None:
            _check_owner(route, caller.owner)
            return requested_id, route
        held = self._per_client.get(caller.name, 0)
        if caller.authenticated:
            limit = caller.max_sessions if caller.max_sessions is not None else self.max_per_client
            who = "this client already holds"
        else:
            limit, who = self.max_per_address, f"callers without a token from {caller.name} already hold"
        if held >= limit:
            raise ResourceExhausted(f"{who} {held} sessions (the limit is {limit}); close some or retry later")
        session_id = new_session_id()
        route = Route("", caller.name)
        self._routes[session_id] = route
        self._per_client[caller.name] = held + 1
        return session_id, route

    def remove(self, session_id: str) -> Route | None:
        """Forget a session; returns its route if it had one."""
        route = self._routes.pop(session_id, None)
        if route is not None:
            left = self._per_client[route.client] - 1
            if left:
                self._per_client[route.client] = left
            else:
                del self._per_client[route.client]
        return route

    def count(self, replica: str) -> int:
        """Sessions routed to `replica`."""
        return sum(r.replica == replica for r in self._routes.values())

    def lost(self, replica: str) -> int:
        """`replica` died and took its sessions with it: drop their routes, except those being opened
        right now (their open fails too and places them again under the same id). Returns how many."""
        gone = [sid for sid, r in self._routes.items() if r.replica == replica and not r.opening]
        for sid in gone:
            self.remove(sid)
        return len(gone)

    def unrouted(self, replica: str, held: set[str]) -> list[str]:
        """Sessions `replica` holds that no route points to there (closed while opening, say)."""
        return [sid for sid in held if (r := self._routes.get(sid)) is None or r.replica != replica]

    def reconcile(self, replica: str, held: set[str], asked_at: float) -> int:
        """Drop routes to `replica` that it no longer holds (expired or evicted there).

        `held` is the replica's list as of a request sent at `asked_at`; routes made after that, and
        sessions still opening, are kept. Returns how many routes were dropped.
        """
        stale = [sid for sid, r in self._routes.items()
                 if r.replica == replica and sid not in held and not r.opening and r.routed_at < asked_at]
        for sid in stale:
            self.remove(sid)
        return len(stale)


def _check_owner(route: Route, owner: str) -> None:
    """PermissionDenied unless the authenticated identity `owner` opened the session (anonymous callers,
    owner "", are not checked: without credentials the unguessable id is the only proof of holding a
    session)."""
    if owner and route.client != owner:
        raise PermissionDenied("this session belongs to another identity")
