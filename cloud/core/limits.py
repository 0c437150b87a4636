"""A replica's serving limits and batching defaults: the one place they live.

Free of torch, Ray and gRPC, so configuration (cloud/config.py, the CLI) can be read and checked
before anything heavy is imported.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...common.config import Choice, check_fields, setting


class PrefixScope(Choice):
    """Whose cached prefixes a new session may start from (cloud/core/prefixes.py)."""

    OFF = "off"  # none: every session prefills its whole prompt
    IDENTITY = "identity"  # those computed by sessions of the same identity (anonymous callers are one)
    SHARED = "shared"  # any identity's: an operator's choice, never a client's (a timing side channel)


class Hold(Choice):
    """Which policy holds a replica's queued rounds for the company of others' (cloud/core/holding.py)."""

    COMPANY = "company"  # every recently active session's, at most max_wait
    COHORT = "cohort"  # those of the sessions the same pass answered, at most max_wait
    QUORUM = "quorum"  # most active sessions', at most max_wait or the last pass's time
    AUTO = "auto"  # quorum where one group pays (sessions return sooner than a pass's fixed part), else cohort


DEFAULT_MAX_BATCH = 16  # sessions' rounds scored in one forward pass at most
DEFAULT_MAX_WAIT_MS = 2.0  # how long a round waits for recently active sessions' rounds
DEFAULT_HOLD = Hold.AUTO  # which ones it waits for (docs/measurements.md, "Rounds that meet")
# A step with a prompt chunk takes about this long while others wait: about one round on a CPU core.
DEFAULT_PREFILL_BUDGET_MS = 60.0
DEFAULT_FAIR_SHARE = True  # passes shared among identities by weight (cloud/core/passes.py)


@dataclass(frozen=True)
class VerifierLimits:
    """Per-replica limits; requests beyond them get an explicit status."""

    max_context: int = setting(4096, "committed + draft tokens per session", ge=1)
    max_draft: int = setting(32, "longest draft block accepted (and deepest draft tree)", ge=1)
    max_tree_nodes: int = setting(64, "most nodes of a draft tree scored in one pass; 0 = chains only (also "
                                      "when the engine cannot score trees)", ge=0)
    max_sessions: int = setting(64, "sessions per replica; more get RESOURCE_EXHAUSTED", ge=1)
    idle_timeout_s: int = setting(600, "an idle session is dropped after this many seconds", ge=1)
    kv_cache_tokens: int = setting(65536, "KV cache per replica in tokens, everything its sessions cache (torch: a "
                                          "page pool allocated once; llamacpp: kv_streams x max_context cells "
                                          "allocated once, the rest for idle sessions parked in host memory); "
                                          "when it is full idle sessions are evicted, of the identity most over "
                                          "its share first", ge=1)
    kv_streams: int = setting(8, "llamacpp: sessions whose KV is resident at once, in a stream of max_context "
                                 "cells each; an idle session beyond them is parked in host memory and "
                                 "restored when it runs again", ge=1, le=256)
    prefix_scope: PrefixScope = setting(PrefixScope.IDENTITY, "a new session starts from the KV of the longest "
                                        "prefix of its prompt already cached by a session of: its own identity "
                                        "(anonymous callers share one); shared = any identity's (a timing side "
                                        "channel between tenants: an operator's choice); off = never")
    prefix_cache_tokens: int = setting(16384, "KV of closed sessions kept for new sessions to start from, in "
                                              "tokens (least recently used out, and first out when room is "
                                              "needed); 0 = only live sessions' prefixes", ge=0)
    prefill_chunk: int = setting(128, "prompt tokens per forward pass at most (fewer while others wait)", ge=1)

    def __post_init__(self) -> None:
        check_fields(self)
