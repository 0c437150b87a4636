"""Per-edge credentials: bearer tokens mapped to named identities, each with optional limits of its own.

One file format serves the cloud front door (gRPC `authorization: Bearer …` metadata) and `edge
serve` (OpenAI API keys). The file holds SHA-256 digests, never tokens, so reading it (a backup, a
leaked volume) does not let anyone in; `hybridspec token add` draws a token, prints it once and
stores its digest. Tokens carry 256 random bits, so a digest lookup is as good as a comparison.

    # hybridspec credentials (hybridspec token add/remove/list)
    identities:
      lab-laptop:
        sha256: 3b1f…(64 hex digits)
        max_sessions: 8        # optional: overrides the server's per-client session limit
        tokens_per_s: 2000     # optional: overrides the server's per-client rate
        weight: 2              # optional: its share of a replica's passes and KV cells (default 1)

A server re-reads the file when it changes (checked at most once a second), so adding or revoking an
edge needs no restart; a file that became unreadable or invalid keeps the last good table in force
(and is logged), never an open door.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError
from ..protocol.errors import Unauthenticated

log = logging.getLogger(__name__)

TOKEN_PREFIX = "hs_"  # recognisable in logs and by secret scanners
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
DIGEST_PATTERN = re.compile(r"[0-9a-f]{64}")
MAX_TOKEN_CHARS = 256  # longer bearer values are refused unread
RELOAD_CHECK_S = 1.0  # how often the file's modification time is looked at
DEFAULT_WEIGHT = 1.0  # an identity's share weight when its entry sets none (anonymous callers too)
MAX_WEIGHT = 1000.0  # a larger ratio between two tenants' shares would starve the lighter one in practice
HEADER = "# hybridspec credentials: edit with `hybridspec token add/remove/list`; only digests are stored\n"


@dataclass(frozen=True)
class Identity:
    """Who is calling. Authenticated identities come from a credentials file; without one every caller is
    anonymous and named by its peer address (limits still apply per address)."""

    name: str
    authenticated: bool = False
    max_sessions: int | None = None  # None: the server's per-client default
    tokens_per_s: float | None = None  # None: the server's per-client default
    # Its share of a replica's passes and KV cells against the other identities with work there
    # (cloud/core/passes.py): an identity of weight 2 gets twice the share of one of weight 1.
    weight: float = DEFAULT_WEIGHT

    @property
    def owner(self) -> str:
        """What the sessions this identity opens record as their owner ("" for anonymous callers,
        whose sessions any holder of the id may use)."""
        return self.name if self.authenticated else ""


def anonymous(peer: str) -> Identity:
    """The identity of a caller on a server without credentials."""
    return Identity(name=peer, authenticated=False)


def new_token() -> str:
    """A fresh bearer token: the prefix and 256 random bits."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def digest(token: str) -> str:
    """The hex SHA-256 of a token, as the credentials file stores it."""
    return hashlib.sha256(token.encode()).hexdigest()


def bearer(value: str | None) -> str | None:
    """The token in an `Authorization` value (`Bearer TOKEN`, scheme case-insensitive), or None."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN_CHARS:
        return None
    return token


def parse_credentials(data: Any, source: str) -> dict[str, Identity]:
    """digest -> Identity from a loaded credentials mapping; ConfigError naming the first bad entry."""
    if data is None:
        data = {}
    if not isinstance(data, dict) or set(data) - {"identities"}:
        raise ConfigError(f"credentials file {source} must hold one key, identities")
    entries = data.get("identities") or {}
    if not isinstance(entries, dict):
        raise ConfigError(f"credentials file {source}: identities must map names to entries")
    table: dict[str, Identity] = {}
    for name, entry in entries.items():
        where = f"credentials file {source}, identity {name!r}"
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise ConfigError(f"{where}: names are 1-64 letters, digits, '.', '_', '@' or '-'")
        if not isinstance(entry, dict) or set(entry) - {"sha256", "max_sessions", "tokens_per_s", "weight"}:
            raise ConfigError(f"{where}: an entry has sha256 and optionally max_sessions, tokens_per_s, weight")
        token_digest = entry.get("sha256")
        if not isinstance(token_digest, str) or not DIGEST_PATTERN.fullmatch(token_digest):
            raise ConfigError(f"{where}: sha256 must be 64 lowercase hex digits (hybridspec token add writes it)")
        if token_digest in table:
            raise ConfigError(f"{where}: the same token digest as identity {table[token_digest].name!r}")
        max_sessions = entry.get("max_sessions")
        if max_sessions is not None and (isinstance(max_sessions, bool) or not isinstance(max_sessions, int)
                                         or max_sessions < 1):
            raise ConfigError(f"{where}: max_sessions must be an integer >= 1")
        rate = entry.get("tokens_per_s")
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0):
            raise ConfigError(f"{where}: tokens_per_s must be a number > 0")
        weight = entry.get("weight", DEFAULT_WEIGHT)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= MAX_WEIGHT:
            raise ConfigError(f"{where}: weight must be a number in (0, {MAX_WEIGHT:g}]")
        table[token_digest] = Identity(name, True, max_sessions, None if rate is None else float(rate), float(weight))
    return table


def read_credentials(path: str | Path) -> dict[str, Identity]:
    """The credentials table in a file; ConfigError (one line) if it is missing or invalid."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"credentials file {p} cannot be read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(f"credentials file {p} is not valid YAML") from None
    return parse_credentials(data, str(p))


class CredentialStore:
    """The identities of one credentials file, re-read when the file changes."""

    def __init__(self, path: str | Path) -> None:
        """ConfigError if the file cannot be used now."""
        self.path = Path(path)
        self._stamp = self._file_stamp()
        self._table = read_credentials(self.path)
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._table)

    def identify(self, token: str | None) -> Identity:
        """The identity a bearer token belongs to; Unauthenticated (naming no identity) otherwise."""
        if token is None:
            raise Unauthenticated("missing credentials: send 'authorization: Bearer TOKEN'")
        self._refresh()
        identity = self._table.get(digest(token))
        if identity is None:
            raise Unauthenticated("invalid credentials: the token is not known to this server")
        return identity

    def named(self, name: str) -> Identity | None:
        """The identity of that name, if the file (as last read) has it."""
        self._refresh()
        return next((identity for identity in self._table.values() if identity.name == name), None)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_S:
            return
        with self._lock:
            if now - self._checked < RELOAD_CHECK_S:
                return
            self._checked = now
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return
            try:
                self._table = read_credentials(self.path)
                log.info("credentials reloaded from %s: %d identities", self.path, len(self._table))
            except ConfigError as exc:
                log.error("%s; keeping the %d identities loaded before", exc, len(self._table))
            self._stamp = stamp

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino


# ---- editing a credentials file (hybridspec token …) --------------------------------------------

def _entries(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    read_credentials(path)  # refuse to rewrite a file that is not valid
    return dict((yaml.safe_load(path.read_text()) or {}).get("identities") or {})


def _write(path: Path, entries: dict[str, dict]) -> None:
    """Replace the file atomically, readable by its owner only."""
    text = HEADER + yaml.safe_dump({"identities": entries}, sort_keys=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".credentials-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add_identity(path: str | Path, name: str, max_sessions: int | None = None,
                 tokens_per_s: float | None = None, weight: float | None = None) -> str:
    """Add `name` with a fresh token (replacing its old token, if any); returns the token. ConfigError
    (the file unchanged) for a limit or weight the server would refuse."""
    path = Path(path)
    entries = _entries(path)
    token = new_token()
    entry: dict[str, Any] = {"sha256": digest(token)}
    if max_sessions is not None:
        entry["max_sessions"] = max_sessions
    if tokens_per_s is not None:
        entry["tokens_per_s"] = tokens_per_s
    if weight is not None:
        entry["weight"] = weight
    entries[name] = entry
    parse_credentials({"identities": entries}, str(path))  # the same checks a server makes
    _write(path, entries)
    return token


def remove_identity(path: str | Path, name: str) -> bool:
    """Revoke `name`; True if it was there."""
    path = Path(path)
    entries = _entries(path)
    if entries.pop(name, None) is None:
        return False
    _write(path, entries)
    return True


def list_identities(path: str | Path) -> list[Identity]:
    """Every identity in the file, by name."""
    return sorted(read_credentials(path).values(), key=lambda i: i.name)
