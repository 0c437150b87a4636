"""The cloud side's configuration (deploy/*.yaml holds ready-made ones)."""
from __future__ import annotations

from dataclasses import dataclass

from ..common.config import Choice, choice
from ..common.security.tls import ServerTLS, check_plaintext
from .api.access import DEFAULT_MAX_CALLS, DEFAULT_STREAM_IDLE_S, AccessSpec
from .pool.routing import DEFAULT_MAX_SESSIONS_PER_CLIENT
from ..common.protocol.channel import DEFAULT_HOST, DEFAULT_PORT
from .process import DEFAULT_METRICS_PORT
from .specs import (DEFAULT_MAX_BATCH, DEFAULT_MAX_WAIT_MS, DEFAULT_PREFILL_BUDGET_MS, DType, PoolSpec, ReplicaSpec,
                    VerifierLimits)



class Backend(Choice):
    """What serves the verifiers."""

    RAY = "ray"  # a pool of replica actors
    INPROCESS = "inprocess"  # one verifier in the front door


@dataclass(frozen=True)
class ServeConfig:
    """Everything `hybridspec cloud serve` needs. Empty target means the embedded default."""

    target: str = ""  # model directory, .gguf file or cached hub id; "" = embedded default
    host: str = DEFAULT_HOST  # interface to bind; 0.0.0.0 to serve other hosts
    port: int = DEFAULT_PORT  # 0 picks a free port
    backend: Backend = Backend.RAY  # ray = a pool of replica actors; inprocess = one verifier in the front door
    replicas: int = PoolSpec.replicas  # Ray replicas, each owning one copy of the target
    replica_num_cpus: float = PoolSpec.num_cpus  # Ray CPUs reserved per replica (fractions allowed)
    replica_num_gpus: float = PoolSpec.num_gpus  # Ray GPUs per replica (1 on a GPU cluster)
    ray_address: str = ""  # "" = start a local Ray cluster; "auto" or ray://HOST:10001 joins one
    ray_num_cpus: int = PoolSpec.ray_num_cpus  # CPUs a local cluster advertises; 0 = every core
    ray_local_only: bool = PoolSpec.ray_local_only  # a cluster this server starts listens on 127.0.0.1 only and admits no other node
    direct_verify: bool = True  # (ray) edges stream rounds straight to their replica's own port on `host`
    device: str = ReplicaSpec.device  # auto | cpu | cuda | cuda:N (inside each replica)
    dtype: DType = ReplicaSpec.dtype  # auto | float32 | bfloat16 | float16
    torch_threads: int = ReplicaSpec.torch_threads  # intra-op threads per replica on CPU; 0 keeps torch's default
    max_batch_size: int = DEFAULT_MAX_BATCH  # most rounds scored in one forward pass; 1 turns batching off
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS  # a round waits at most this long for others to batch with
    max_context: int = VerifierLimits.max_context  # committed + draft tokens per session
    max_draft: int = VerifierLimits.max_draft  # longest draft block accepted
    max_sessions: int = VerifierLimits.max_sessions  # sessions per replica; more get RESOURCE_EXHAUSTED
    kv_cache_tokens: int = VerifierLimits.kv_cache_tokens  # per replica KV pool, allocated once; when full, LRU sessions are evicted
    max_sessions_per_client: int = DEFAULT_MAX_SESSIONS_PER_CLIENT  # per token identity over the whole pool; more get RESOURCE_EXHAUSTED
    max_sessions_per_address: int = DEFAULT_MAX_SESSIONS_PER_CLIENT  # callers without a token share this per address
    max_calls_per_client: int = DEFAULT_MAX_CALLS  # concurrent Verifier calls (streams included) per token identity
    max_calls_per_address: int = DEFAULT_MAX_CALLS  # the same for callers without a token, per address
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S  # a VerifyStream that sends nothing for this long is ended
    prefill_chunk: int = VerifierLimits.prefill_chunk  # prompt tokens per forward pass at most (when no other session is waiting)
    prefill_budget_ms: float = DEFAULT_PREFILL_BUDGET_MS  # while others send rounds, a pass with a prompt chunk takes about this long
    replica_wait_s: float = PoolSpec.replica_wait_s  # with every replica down, a new session waits this long for one to restart
    idle_timeout_s: int = VerifierLimits.idle_timeout_s  # idle sessions are dropped after this
    metrics_port: int = DEFAULT_METRICS_PORT  # Prometheus /metrics port; -1 = off, 0 = any free port
    metrics_host: str = DEFAULT_HOST  # interface for /metrics
    grace_s: float = 5.0  # on SIGTERM/SIGINT, in-flight calls get this long to finish
    tls_cert: str = ""  # PEM certificate chain of the front door and the replica endpoints; with tls_key: TLS
    tls_key: str = ""  # PEM private key of tls_cert (both files are re-read when they change)
    tls_client_ca: str = ""  # mutual TLS: every edge must present a certificate this CA signed
    credentials: str = ""  # file of edge tokens and identities (hybridspec token add); "" = no tokens
    client_tokens_per_s: float = 0.0  # target tokens/s per identity without its own rate; 0 = no limit
    insecure: bool = False  # allow plaintext on a non-loopback host (logged as a warning)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be -1 (off) or in [0, 65535], got {self.metrics_port}")
        object.__setattr__(self, "backend", choice(Backend, self.backend, "backend"))
        object.__setattr__(self, "dtype", choice(DType, self.dtype, "dtype"))
        for name in ("replicas", "max_batch_size", "max_context", "max_draft", "max_sessions", "idle_timeout_s",
                     "max_sessions_per_client", "max_sessions_per_address", "max_calls_per_client",
                     "max_calls_per_address", "prefill_chunk", "kv_cache_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("replica_num_cpus", "replica_num_gpus", "max_wait_ms", "ray_num_cpus",
                     "replica_wait_s", "client_tokens_per_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("stream_idle_s", "prefill_budget_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        check_plaintext(self.host, self.access.tls.enabled, self.insecure, "the gRPC front door")

    @property
    def access(self) -> AccessSpec:
        """TLS and credentials of every endpoint edges reach (the front door and replica endpoints)."""
        return AccessSpec(tls=ServerTLS(self.tls_cert, self.tls_key, self.tls_client_ca),
                          credentials=self.credentials, client_tokens_per_s=self.client_tokens_per_s,
                          max_calls_per_client=self.max_calls_per_client,
                          max_calls_per_address=self.max_calls_per_address, stream_idle_s=self.stream_idle_s)

    @property
    def limits(self) -> VerifierLimits:
        """The per-session limits each replica enforces."""
        return VerifierLimits(max_context=self.max_context, max_draft=self.max_draft,
                              max_sessions=self.max_sessions, idle_timeout_s=self.idle_timeout_s,
                              kv_cache_tokens=self.kv_cache_tokens, prefill_chunk=self.prefill_chunk)

    def replica_spec(self, target: str) -> ReplicaSpec:
        """What each replica loads (`target` already resolved to a path or hub id)."""
        return ReplicaSpec(target=target, device=self.device, dtype=self.dtype, torch_threads=self.torch_threads,
                           limits=self.limits, max_batch=self.max_batch_size, max_wait_ms=self.max_wait_ms,
                           prefill_budget_ms=self.prefill_budget_ms,
                           verify_host=self.host if self.direct_verify else "", access=self.access)

    def pool_spec(self, target: str) -> PoolSpec:
        """The Ray pool this config describes."""
        return PoolSpec(replica=self.replica_spec(target), replicas=self.replicas, num_cpus=self.replica_num_cpus,
                        num_gpus=self.replica_num_gpus, ray_address=self.ray_address, ray_num_cpus=self.ray_num_cpus,
                        max_sessions_per_client=self.max_sessions_per_client,
                        max_sessions_per_address=self.max_sessions_per_address, replica_wait_s=self.replica_wait_s,
                        ray_local_only=self.ray_local_only)
