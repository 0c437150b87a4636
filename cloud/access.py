"""Who may call a verifier endpoint, as whom, and how fast: one gatekeeper per gRPC server (the front
door and each replica's own endpoint build theirs from the same AccessSpec, so the rules are the same
wherever an edge's calls land). No gRPC here: the servicer passes in the `authorization` value and
the peer address.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..common.credentials import CredentialStore, Identity, anonymous, bearer
from ..common.tls import ServerTLS
from .quota import RateLimiter


@dataclass(frozen=True)
class AccessSpec:
    """Transport security and credentials of a verifier endpoint (ServeConfig builds it)."""

    tls: ServerTLS = ServerTLS()
    credentials: str = ""  # credentials file (common/credentials.py); "" = no tokens, callers named by address
    client_tokens_per_s: float = 0.0  # per identity without a rate of its own; 0 = no limit (credentials only)

    def __post_init__(self) -> None:
        if self.client_tokens_per_s < 0:
            raise ValueError(f"client_tokens_per_s must be >= 0, got {self.client_tokens_per_s}")


class Access:
    """Identifies callers from their bearer tokens and paces them (AccessSpec in force)."""

    def __init__(self, spec: AccessSpec) -> None:
        """ConfigError if the credentials file cannot be used."""
        self.spec = spec
        self.store = CredentialStore(spec.credentials) if spec.credentials else None
        self.limiter = RateLimiter(spec.client_tokens_per_s)

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
