"""The plain settings the cloud's runtime objects take, and the single place their defaults live.

Free of torch, Ray and gRPC, so configuration (cloud/config.py, the CLI) can be read and checked
before anything heavy is imported; the verifier, the scheduler, the replicas and the pool import
their settings from here.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..common.config import Choice, choice

from .api.access import AccessSpec
from .pool.routing import DEFAULT_MAX_SESSIONS_PER_CLIENT

class DType(Choice):
    """The weights' type in a replica: auto = float32 on a CPU, bfloat16 on a GPU."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


DEFAULT_MAX_BATCH = 16  # sessions' rounds scored in one forward pass at most
DEFAULT_MAX_WAIT_MS = 2.0  # how long a round waits for recently active sessions' rounds
# A step with a prompt chunk takes about this long while others wait: about one round on a CPU core.
DEFAULT_PREFILL_BUDGET_MS = 60.0


@dataclass(frozen=True)
class VerifierLimits:
    """Per-replica limits; requests beyond them get an explicit status."""

    max_context: int = 4096  # committed + draft tokens per session
    max_draft: int = 32  # longest block accepted
    max_sessions: int = 64  # sessions held at once; more get RESOURCE_EXHAUSTED
    idle_timeout_s: int = 600  # an idle session is dropped after this
    kv_cache_tokens: int = 65536  # the KV pool, allocated once; when full, LRU sessions are evicted
    prefill_chunk: int = 128  # prompt tokens per step at most (the scheduler feeds less while others wait)


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica loads and how it batches."""

    target: str  # model directory, .gguf file or cached hub id (resolved by the caller)
    device: str = "auto"
    dtype: DType = DType.AUTO
    torch_threads: int = 0  # CPU intra-op threads; 0 keeps torch's default
    limits: VerifierLimits = VerifierLimits()
    max_batch: int = DEFAULT_MAX_BATCH
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS
    prefill_budget_ms: float = DEFAULT_PREFILL_BUDGET_MS  # a step with a prompt chunk, while others wait
    verify_host: str = ""  # interface of the replica's own Verify endpoint; "" = none (rounds via the front door)
    access: AccessSpec = AccessSpec()  # that endpoint's TLS and credentials: the front door's (files read on this node)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", choice(DType, self.dtype, "dtype"))


@dataclass(frozen=True)
class PoolSpec:
    """How many replicas, with which resources, on which cluster."""

    replica: ReplicaSpec
    replicas: int = 1
    num_cpus: float = 1.0  # Ray CPUs reserved per replica (fractional is fine)
    num_gpus: float = 0.0  # Ray GPUs per replica; 1 on a GPU cluster
    ray_address: str = ""  # "" starts a local cluster; "auto" or "ray://HOST:10001" joins one
    ray_num_cpus: int = 0  # CPUs a local cluster advertises; 0 = every core
    name: str = "hybridspec"  # prefix of the replicas' actor names
    max_sessions_per_client: int = DEFAULT_MAX_SESSIONS_PER_CLIENT  # per token identity, over the whole pool
    max_sessions_per_address: int = DEFAULT_MAX_SESSIONS_PER_CLIENT  # per address for callers without a token
    replica_wait_s: float = 30.0  # a new session waits this long for a restarting replica
    ray_local_only: bool = True  # a cluster the pool starts binds 127.0.0.1 and admits no other node
