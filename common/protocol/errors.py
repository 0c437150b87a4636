"""Domain errors with the gRPC status each one maps to (docs/design.md §4).

The verifier core raises these; the gRPC layer translates them, so neither side needs the other.
"""
from __future__ import annotations

import logging
import secrets


class HybridSpecError(Exception):
    """Base class; `code` names a grpc.StatusCode member. `retry_after_s`, when set, is when retrying may
    succeed: the servicer sends it as gRPC's RetryInfo in the status details."""

    code = "INTERNAL"
    retry_after_s: float | None = None

    def __init__(self, message: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


class InvalidArgument(HybridSpecError):
    """Malformed input: the message names the offending field."""

    code = "INVALID_ARGUMENT"


class FailedPrecondition(HybridSpecError):
    """Unknown or evicted session, round gap, fingerprint mismatch: the edge should re-open."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(HybridSpecError):
    """Too many sessions or too long a context."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(HybridSpecError):
    """Draining or not ready; retryable."""

    code = "UNAVAILABLE"


class Unauthenticated(HybridSpecError):
    """No credentials, or credentials the server does not accept."""

    code = "UNAUTHENTICATED"


class PermissionDenied(HybridSpecError):
    """Valid credentials, but for an identity that may not touch this (another identity's session)."""

    code = "PERMISSION_DENIED"


class Internal(HybridSpecError):
    """A bug or a failed device, never the client's fault. The message carries an incident id that the
    server logged with the traceback; nothing else about the server leaks to the client."""

    code = "INTERNAL"


_BY_CODE = {cls.code: cls for cls in (InvalidArgument, FailedPrecondition, ResourceExhausted, Unavailable,
                                      Unauthenticated, PermissionDenied, Internal)}


def incident(log: logging.Logger, exc: BaseException, during: str) -> Internal:
    """Log an unexpected exception with its traceback under a fresh incident id, and return the
    Internal error the client sees instead: the id, and nothing about the server's internals."""
    incident_id = secrets.token_hex(4)
    log.error("incident %s during %s", incident_id, during, exc_info=(type(exc), exc, exc.__traceback__))
    return Internal(f"internal error during {during} (incident {incident_id}; the server log has the details)")


def error_for_code(code: str, message: str, retry_after_s: float | None = None) -> HybridSpecError:
    """The domain error for a gRPC status name (DEADLINE_EXCEEDED counts as Unavailable)."""
    if code == "DEADLINE_EXCEEDED":
        code = "UNAVAILABLE"
    err = _BY_CODE.get(code, HybridSpecError)(message, retry_after_s)
    err.code = code
    return err
