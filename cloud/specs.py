"""The plain settings the cloud's runtime objects take, and the single place their defaults live.

Free of torch, Ray and gRPC, so configuration (cloud/config.py, the CLI) can be read and checked
before anything heavy is imported; the verifier, the scheduler, the replicas and the pool import
their settings from here.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..common.config import Choice, DType, check_fields, setting
from .api.access import AccessSpec

class EngineKind(Choice):
    """What computes the target's forward passes in a replica (cloud/engine/)."""

    AUTO = "auto"  # llama.cpp on a CPU when the target has a GGUF file, else torch
    TORCH = "torch"  # Hugging Face weights in torch: the GPU path and the reference
    LLAMACPP = "llamacpp"  # the GGUF file in llama.cpp's CPU kernels


class PrefixScope(Choice):
    """Whose cached prefixes a new session may start from (cloud/core/prefixes.py)."""

    OFF = "off"  # none: every session prefills its whole prompt
    IDENTITY = "identity"  # those computed by sessions of the same identity (anonymous callers are one)
    SHARED = "shared"  # any identity's: an operator's choice, never a client's (a timing side channel)


DEFAULT_MAX_BATCH = 16  # sessions' rounds scored in one forward pass at most
DEFAULT_MAX_WAIT_MS = 2.0  # how long a round waits for recently active sessions' rounds
# A step with a prompt chunk takes about this long while others wait: about one round on a CPU core.
DEFAULT_PREFILL_BUDGET_MS = 60.0


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
                                          "when it is full the least recently used idle sessions are evicted", ge=1)
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


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica loads and how it batches."""

    target: str  # model directory, .gguf file or cached hub id (resolved by the caller)
    engine: EngineKind = setting(EngineKind.AUTO, "what computes the target: llamacpp serves its GGUF file on a "
                                                  "CPU; torch its Hugging Face weights; auto = llamacpp on a CPU "
                                                  "when the target has a GGUF file and dtype is auto, else torch")
    device: str = setting("auto", "where each replica computes: auto, cpu, cuda or cuda:N")
    dtype: DType = setting(DType.AUTO, "the target's weights in each replica (torch engine; llama.cpp serves the "
                                       "GGUF's own type); auto = float32 on a CPU, bfloat16 on a GPU")
    torch_threads: int = setting(0, "compute threads per replica on a CPU; 0 = the engine's default (torch's "
                                    "own, 1 for llama.cpp)", ge=0)
    limits: VerifierLimits = VerifierLimits()
    max_batch: int = setting(DEFAULT_MAX_BATCH, "most rounds scored in one forward pass; 1 turns batching off",
                             ge=1)
    max_wait_ms: float = setting(DEFAULT_MAX_WAIT_MS, "a round waits at most this long for others to batch with",
                                 ge=0)
    prefill_budget_ms: float = setting(DEFAULT_PREFILL_BUDGET_MS, "while others send rounds, a pass carrying a "
                                                                  "prompt chunk takes about this long", gt=0)
    pass_cost_tokens: int = setting(32, "at start a replica times passes of 1 to this many tokens and reports "
                                        "the curve to edges, which size their blocks by it; 0 = do not measure",
                                    ge=0)
    verify_host: str = ""  # interface of the replica's own Verify endpoint; "" = none (rounds via the front door)
    access: AccessSpec = AccessSpec()  # that endpoint's TLS and credentials: the front door's (files read on this node)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class PoolSpec:
    """How many replicas, with which resources, on which cluster."""

    replica: ReplicaSpec
    replicas: int = setting(1, "Ray replicas, each with its own copy of the target", ge=1)
    num_cpus: float = setting(1.0, "Ray CPUs reserved per replica (fractions allowed)", ge=0)
    num_gpus: float = setting(0.0, "Ray GPUs per replica (1 on a GPU cluster)", ge=0)
    ray_address: str = setting("", "the Ray cluster to join: its head's HOST:PORT, auto (the one `ray start` "
                                   "made on this machine, or RAY_ADDRESS) or ray://HOST:10001; empty: start a "
                                   "local one, whatever RAY_ADDRESS says")
    ray_join_timeout_s: float = setting(30.0, "joining a cluster: how long its head may take to answer before "
                                              "the server gives up with an error", gt=0)
    ray_num_cpus: int = setting(0, "CPUs a local cluster advertises; 0 = every core", ge=0)
    niceness: int = setting(0, "scheduling niceness of each replica's process (Ray starts its workers at 15, "
                               "which makes a replica yield its core to everything else on the node)", ge=0, le=19)
    name: str = "hybridspec"  # prefix of the replicas' actor names
    max_sessions_per_client: int = setting(32, "sessions one token identity may hold over the whole pool; more "
                                               "get RESOURCE_EXHAUSTED", ge=1)
    max_sessions_per_address: int = setting(32, "the same for callers without a token, per address", ge=1)
    replica_wait_s: float = setting(30.0, "with every replica down, a new session waits this long for one to "
                                          "restart", ge=0)
    ray_local_only: bool = setting(True, "a cluster this server starts listens on 127.0.0.1 only and admits "
                                         "no other node")

    def __post_init__(self) -> None:
        check_fields(self)
