"""The cloud side's configuration (deploy/*.yaml holds ready-made ones)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..common.config import Choice, DType, Sections, check_fields, like, setting
from ..common.protocol.channel import DEFAULT_HOST, DEFAULT_PORT
from ..common.security.tls import ServerTLS, check_plaintext
from .api.access import AccessSpec
from .core.limits import VerifierLimits
from .engine.kinds import EngineKind
from .pool.specs import PoolSpec, ReplicaSpec

if TYPE_CHECKING:
    from .api.server import ReplicaEndpoint


class Backend(Choice):
    """What serves the verifiers."""

    RAY = "ray"  # a pool of replica actors
    INPROCESS = "inprocess"  # one verifier in the front door


@dataclass(frozen=True)
class ServerSettings:
    """The front door: what it serves and where, how it stops, and its metrics port."""

    target: str = setting("", 'model directory, .gguf file or cached hub id; empty: the embedded default')
    host: str = setting(DEFAULT_HOST, "interface to bind; 0.0.0.0 serves other hosts")
    port: int = setting(DEFAULT_PORT, "port to bind; 0 = any free port", ge=0, le=65535)
    backend: Backend = setting(Backend.RAY, "ray: a pool of replica actors; inprocess: one verifier inside the "
                                            "front door")
    direct_verify: bool = setting(True, "(ray) edges stream rounds straight to their replica's own port on the "
                                        "host")
    metrics_port: int = setting(9464, "Prometheus /metrics port; -1 = off, 0 = any free port", ge=-1, le=65535)
    metrics_host: str = setting(DEFAULT_HOST, "interface of /metrics")
    grace_s: float = setting(5.0, "on SIGTERM or SIGINT, calls in flight get this long to finish", ge=0)
    insecure: bool = setting(False, "allow plaintext on a non-loopback host (logged as a warning)")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class ServerAccess:
    """Who may call, over what: TLS, credentials and per-caller call limits of every endpoint edges reach."""

    tls_cert: str = setting("", "PEM certificate chain of the front door and the replica endpoints: serve TLS "
                                "(with tls_key; both files are re-read when they change)")
    tls_key: str = setting("", "PEM private key of tls_cert")
    tls_client_ca: str = setting("", "mutual TLS: every edge must present a certificate this CA signed")
    credentials: str = like(AccessSpec, "credentials")
    client_tokens_per_s: float = like(AccessSpec, "client_tokens_per_s")
    max_calls_per_client: int = like(AccessSpec, "max_calls_per_client")
    max_calls_per_address: int = like(AccessSpec, "max_calls_per_address")
    stream_idle_s: float = like(AccessSpec, "stream_idle_s")

    def __post_init__(self) -> None:
        check_fields(self)

    def spec(self) -> AccessSpec:
        """TLS and credentials of every endpoint edges reach (the front door and replica endpoints)."""
        return AccessSpec(tls=ServerTLS(self.tls_cert, self.tls_key, self.tls_client_ca),
                          credentials=self.credentials, client_tokens_per_s=self.client_tokens_per_s,
                          max_calls_per_client=self.max_calls_per_client,
                          max_calls_per_address=self.max_calls_per_address, stream_idle_s=self.stream_idle_s)


@dataclass(frozen=True)
class PoolSettings:
    """The Ray pool: its replicas' number and resources, the cluster it runs on, sessions per caller."""

    replicas: int = like(PoolSpec, "replicas")
    replica_num_cpus: float = like(PoolSpec, "num_cpus")
    replica_num_gpus: float = like(PoolSpec, "num_gpus")
    ray_address: str = like(PoolSpec, "ray_address")
    ray_join_timeout_s: float = like(PoolSpec, "ray_join_timeout_s")
    ray_num_cpus: int = like(PoolSpec, "ray_num_cpus")
    ray_local_only: bool = like(PoolSpec, "ray_local_only")
    replica_niceness: int = like(PoolSpec, "niceness")
    max_sessions_per_client: int = like(PoolSpec, "max_sessions_per_client")
    max_sessions_per_address: int = like(PoolSpec, "max_sessions_per_address")
    replica_wait_s: float = like(PoolSpec, "replica_wait_s")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class ReplicaSettings:
    """What each replica computes with and how it batches."""

    engine: EngineKind = like(ReplicaSpec, "engine")
    device: str = like(ReplicaSpec, "device")
    dtype: DType = like(ReplicaSpec, "dtype")
    torch_threads: int = like(ReplicaSpec, "torch_threads")
    max_batch_size: int = like(ReplicaSpec, "max_batch")
    max_wait_ms: float = like(ReplicaSpec, "max_wait_ms")
    pass_cost_tokens: int = like(ReplicaSpec, "pass_cost_tokens")
    prefill_budget_ms: float = like(ReplicaSpec, "prefill_budget_ms")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class ServeConfig(Sections):
    """Everything `hybridspec cloud serve` needs, by concern: one flag per setting (cli/flags.py), and a
    YAML file may name a setting flat or under its section. `limits` is the replicas' own
    `VerifierLimits`; the other sections pass their settings on to the specs that own their defaults
    (`like`). `ServeConfig.of(max_context=2048)` builds one from flat names."""

    server: ServerSettings = ServerSettings()
    access: ServerAccess = ServerAccess()
    pool: PoolSettings = PoolSettings()
    replica: ReplicaSettings = ReplicaSettings()
    limits: VerifierLimits = VerifierLimits()

    def __post_init__(self) -> None:
        check_plaintext(self.server.host, self.access_spec().tls.enabled, self.server.insecure, "the gRPC front door")

    def access_spec(self) -> AccessSpec:
        """TLS and credentials of every endpoint edges reach (the front door and replica endpoints)."""
        return self.access.spec()

    def replica_spec(self, target: str) -> ReplicaSpec:
        """What each replica loads (`target` already resolved to a path or hub id)."""
        r = self.replica
        return ReplicaSpec(target=target, engine=r.engine, device=r.device, dtype=r.dtype, torch_threads=r.torch_threads,
                           limits=self.limits, max_batch=r.max_batch_size, max_wait_ms=r.max_wait_ms,
                           prefill_budget_ms=r.prefill_budget_ms, pass_cost_tokens=r.pass_cost_tokens)

    def replica_endpoint(self) -> ReplicaEndpoint | None:
        """The endpoint each Ray replica serves its sessions' rounds on, on the front door's interface
        with its access rules; None without direct_verify (rounds then go through the front door)."""
        if not self.server.direct_verify:
            return None
        from .api.server import ReplicaEndpoint  # gRPC: only once a pool is built

        return ReplicaEndpoint(self.server.host, self.access_spec())

    def pool_spec(self, target: str) -> PoolSpec:
        """The Ray pool this config describes."""
        p = self.pool
        return PoolSpec(replica=self.replica_spec(target), replicas=p.replicas, num_cpus=p.replica_num_cpus,
                        num_gpus=p.replica_num_gpus, ray_address=p.ray_address,
                        ray_join_timeout_s=p.ray_join_timeout_s, ray_num_cpus=p.ray_num_cpus,
                        max_sessions_per_client=p.max_sessions_per_client,
                        max_sessions_per_address=p.max_sessions_per_address, replica_wait_s=p.replica_wait_s,
                        ray_local_only=p.ray_local_only, niceness=p.replica_niceness)
