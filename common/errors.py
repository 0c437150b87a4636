"""Domain errors with the gRPC status each one maps to (design brief §4).

The verifier core raises these; the gRPC layer translates them, so neither side needs the other.
"""
from __future__ import annotations


class HybridSpecError(Exception):
    """Base class; `code` names a grpc.StatusCode member."""

    code = "INTERNAL"


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


_BY_CODE = {cls.code: cls for cls in (InvalidArgument, FailedPrecondition, ResourceExhausted, Unavailable)}


def error_for_code(code: str, message: str) -> HybridSpecError:
    """The domain error for a gRPC status name (DEADLINE_EXCEEDED counts as Unavailable)."""
    if code == "DEADLINE_EXCEEDED":
        code = "UNAVAILABLE"
    err = _BY_CODE.get(code, HybridSpecError)(message)
    err.code = code
    return err
