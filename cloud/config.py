"""The cloud side's configuration (deploy/*.yaml holds ready-made ones)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..common.config import Choice, DType, check_fields, like, setting
from ..common.protocol.channel import DEFAULT_HOST, DEFAULT_PORT
from ..common.security.tls import ServerTLS, check_plaintext
from .api.access import AccessSpec
from .core.limits import PrefixScope, VerifierLimits
from .engine.kinds import EngineKind
from .pool.specs import PoolSpec, ReplicaSpec

if TYPE_CHECKING:
    from .api.server import ReplicaEndpoint


class Backend(Choice):
    """What serves the verifiers."""

    RAY = "ray"  # a pool of replica actors
    INPROCESS = "inprocess"  # one verifier in the front door


@dataclass(frozen=True)
class ServeConfig:
    """Everything `hybridspec cloud serve` needs: one flag per field (cli/flags.py). The settings it
    passes on to a spec take that spec's default, help and bounds (`like`)."""

    target: str = setting("", 'model directory, .gguf file or cached hub id; empty: the embedded default')
    host: str = setting(DEFAULT_HOST, "interface to bind; 0.0.0.0 serves other hosts")
    port: int = setting(DEFAULT_PORT, "port to bind; 0 = any free port", ge=0, le=65535)
    backend: Backend = setting(Backend.RAY, "ray: a pool of replica actors; inprocess: one verifier inside the "
                                            "front door")
    replicas: int = like(PoolSpec, "replicas")
    replica_num_cpus: float = like(PoolSpec, "num_cpus")
    replica_num_gpus: float = like(PoolSpec, "num_gpus")
    ray_address: str = like(PoolSpec, "ray_address")
    ray_join_timeout_s: float = like(PoolSpec, "ray_join_timeout_s")
    ray_num_cpus: int = like(PoolSpec, "ray_num_cpus")
    ray_local_only: bool = like(PoolSpec, "ray_local_only")
    replica_niceness: int = like(PoolSpec, "niceness")
    direct_verify: bool = setting(True, "(ray) edges stream rounds straight to their replica's own port on the "
                                        "host")
    engine: EngineKind = like(ReplicaSpec, "engine")
    device: str = like(ReplicaSpec, "device")
    dtype: DType = like(ReplicaSpec, "dtype")
    torch_threads: int = like(ReplicaSpec, "torch_threads")
    max_batch_size: int = like(ReplicaSpec, "max_batch")
    max_wait_ms: float = like(ReplicaSpec, "max_wait_ms")
    pass_cost_tokens: int = like(ReplicaSpec, "pass_cost_tokens")
    max_context: int = like(VerifierLimits, "max_context")
    max_draft: int = like(VerifierLimits, "max_draft")
    max_tree_nodes: int = like(VerifierLimits, "max_tree_nodes")
    max_sessions: int = like(VerifierLimits, "max_sessions")
    kv_cache_tokens: int = like(VerifierLimits, "kv_cache_tokens")
    kv_streams: int = like(VerifierLimits, "kv_streams")
    prefix_scope: PrefixScope = like(VerifierLimits, "prefix_scope")
    prefix_cache_tokens: int = like(VerifierLimits, "prefix_cache_tokens")
    max_sessions_per_client: int = like(PoolSpec, "max_sessions_per_client")
    max_sessions_per_address: int = like(PoolSpec, "max_sessions_per_address")
    max_calls_per_client: int = like(AccessSpec, "max_calls_per_client")
    max_calls_per_address: int = like(AccessSpec, "max_calls_per_address")
    stream_idle_s: float = like(AccessSpec, "stream_idle_s")
    prefill_chunk: int = like(VerifierLimits, "prefill_chunk")
    prefill_budget_ms: float = like(ReplicaSpec, "prefill_budget_ms")
    replica_wait_s: float = like(PoolSpec, "replica_wait_s")
    idle_timeout_s: int = like(VerifierLimits, "idle_timeout_s")
    metrics_port: int = setting(9464, "Prometheus /metrics port; -1 = off, 0 = any free port", ge=-1, le=65535)
    metrics_host: str = setting(DEFAULT_HOST, "interface of /metrics")
    grace_s: float = setting(5.0, "on SIGTERM or SIGINT, calls in flight get this long to finish", ge=0)
    tls_cert: str = setting("", "PEM certificate chain of the front door and the replica endpoints: serve TLS "
                                "(with tls_key; both files are re-read when they change)")
    tls_key: str = setting("", "PEM private key of tls_cert")
    tls_client_ca: str = setting("", "mutual TLS: every edge must present a certificate this CA signed")
    credentials: str = like(AccessSpec, "credentials")
    client_tokens_per_s: float = like(AccessSpec, "client_tokens_per_s")
    insecure: bool = setting(False, "allow plaintext on a non-loopback host (logged as a warning)")

    def __post_init__(self) -> None:
        check_fields(self)
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
                              max_tree_nodes=self.max_tree_nodes, max_sessions=self.max_sessions, idle_timeout_s=self.idle_timeout_s,
                              kv_cache_tokens=self.kv_cache_tokens, kv_streams=self.kv_streams,
                              prefix_scope=self.prefix_scope, prefix_cache_tokens=self.prefix_cache_tokens,
                              prefill_chunk=self.prefill_chunk)

    def replica_spec(self, target: str) -> ReplicaSpec:
        """What each replica loads (`target` already resolved to a path or hub id)."""
        return ReplicaSpec(target=target, engine=self.engine, device=self.device, dtype=self.dtype, torch_threads=self.torch_threads,
                           limits=self.limits, max_batch=self.max_batch_size, max_wait_ms=self.max_wait_ms,
                           prefill_budget_ms=self.prefill_budget_ms, pass_cost_tokens=self.pass_cost_tokens)

    def replica_endpoint(self) -> ReplicaEndpoint | None:
        """The endpoint each Ray replica serves its sessions' rounds on, on the front door's interface
        with its access rules; None without direct_verify (rounds then go through the front door)."""
        if not self.direct_verify:
            return None
        from .api.server import ReplicaEndpoint  # gRPC: only once a pool is built

        return ReplicaEndpoint(self.host, self.access)

    def pool_spec(self, target: str) -> PoolSpec:
        """The Ray pool this config describes."""
        return PoolSpec(replica=self.replica_spec(target), replicas=self.replicas, num_cpus=self.replica_num_cpus,
                        num_gpus=self.replica_num_gpus, ray_address=self.ray_address,
                        ray_join_timeout_s=self.ray_join_timeout_s, ray_num_cpus=self.ray_num_cpus,
                        max_sessions_per_client=self.max_sessions_per_client,
                        max_sessions_per_address=self.max_sessions_per_address, replica_wait_s=self.replica_wait_s,
                        ray_local_only=self.ray_local_only, niceness=self.replica_niceness)
