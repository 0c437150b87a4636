"""Who may call a verifier endpoint, as whom, how many calls at once and how fast: one gatekeeper per
gRPC server (the front door and each replica's own endpoint build theirs from the same AccessSpec, so
the rules are the same wherever an edge's calls land). No gRPC here: cloud/api/admission.py and the
servicer pass in the `authorization` value and the peer address.

Two kinds of caller, with limits of their own: an identity from the credentials file (its token's
name), and, on a server without credentials, an anonymous caller named by its address. Every caller
from one address is the same anonymous client (all local processes share 127.0.0.1), so the
anonymous limits are per address and set apart from the per-token ones.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ...common.config import check_fields, setting
from ...common.security.credentials import CredentialStore, Identity, anonymous, bearer
from ...common.protocol.errors import ResourceExhausted
from ...common.security.tls import ServerTLS
from .quota import RateLimiter

@dataclass(frozen=True)
class AccessSpec:
    """Transport security, credentials and per-caller limits of a verifier endpoint: ServeConfig's
    `access` section itself, handed whole to the front door and every replica endpoint."""

    tls_cert: str = setting("", "PEM certificate chain of the front door and the replica endpoints: serve TLS "
                                "(with tls_key; both files are re-read when they change)")
    tls_key: str = setting("", "PEM private key of tls_cert")
    tls_client_ca: str = setting("", "mutual TLS: every edge must present a certificate this CA signed")
    credentials: str = setting("", "file of edge tokens and identities (hybridspec token add); every call then "
                                   "needs one. Empty: no tokens, callers are named by their address")
    client_tokens_per_s: float = setting(0.0, "target tokens per second per identity without a rate of its own; "
                                              "0 = no limit", ge=0)
    # Twice the default session limit: a stream per session plus the unary calls around it.
    max_calls_per_client: int = setting(64, "concurrent Verifier calls (streams included) per token identity",
                                        ge=1)
    max_calls_per_address: int = setting(64, "the same for callers without a token, per address", ge=1)
    # An edge sends rounds back to back: a minute of silence is a stream left behind.
    stream_idle_s: float = setting(60.0, "a VerifyStream that sends nothing for this long is ended", gt=0)

    def __post_init__(self) -> None:
        check_fields(self)
        self.tls  # ConfigError now for a certificate without its key, or a client CA without both

    @property
    def tls(self) -> ServerTLS:
        """The endpoint's certificate, key and client CA (all empty: plaintext)."""
        return ServerTLS(self.tls_cert, self.tls_key, self.tls_client_ca)


class Access:
    """Identifies callers from their bearer tokens and paces them (AccessSpec in force)."""

    def __init__(self, spec: AccessSpec) -> None:
        """ConfigError if the credentials file cannot be used."""
        self.spec = spec
        self.store = CredentialStore(spec.credentials) if spec.credentials else None
        self.limiter = RateLimiter(spec.client_tokens_per_s)
        self._calls: dict[str, int] = {}  # identity name -> calls it holds open on this endpoint

    def identify(self, authorization: str | None, peer: str) -> Identity:
        """The caller: the identity its token names (Unauthenticated if there is none or it is not
        known), or, on a server without credentials, the anonymous identity of its address."""
        if self.store is None:
            return anonymous(peer)
        return self.store.identify(bearer(authorization))

    def pace(self, caller: Identity, tokens: int) -> float:
        """Seconds the caller's request of `tokens` target tokens must wait (ResourceExhausted if too
        long). Rates apply to identities from the credentials file only."""
        if not caller.authenticated:
            return 0.0
        return self.limiter.charge(caller, tokens, time.monotonic())

    def pace_named(self, name: str, tokens: int) -> float:
        """`pace` for the identity of that name (an authenticated owner, as a session or round records it;
        "" or a name the credentials file no longer has: nothing to pace)."""
        identity = self.store.named(name) if self.store is not None and name else None
        return self.pace(identity, tokens) if identity is not None else 0.0

    def enter_call(self, caller: Identity) -> None:
        """Count a call the caller starts; ResourceExhausted (counting nothing) if it already holds its
        limit. Every call that entered must `leave_call` once."""
        held = self._calls.get(caller.name, 0)
        if caller.authenticated:
            limit, who = self.spec.max_calls_per_client, f"{caller.name} already holds"
        else:
            limit, who = self.spec.max_calls_per_address, f"callers without a token from {caller.name} already hold"
        if held >= limit:
            raise ResourceExhausted(f"{who} {held} calls open (the limit is {limit}); end some or retry later")
        self._calls[caller.name] = held + 1

    def leave_call(self, caller: Identity) -> None:
        """A call counted by `enter_call` ended."""
        left = self._calls[caller.name] - 1
        if left:
            self._calls[caller.name] = left
        else:
            del self._calls[caller.name]

