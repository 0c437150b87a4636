"""The cloud side's configuration (deploy/*.yaml holds ready-made ones)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..common.config import Choice, Sections, check_fields, setting
from ..common.protocol.channel import DEFAULT_HOST, DEFAULT_PORT
from ..common.security.tls import check_plaintext
from .api.access import AccessSpec
from .core.limits import VerifierLimits
from .pool.specs import PoolSettings, PoolSpec, ReplicaSettings, ReplicaSpec

if TYPE_CHECKING:
    from .api.server import ReplicaEndpoint


class Backend(Choice):
    """What serves the verifiers."""

    RAY = "ray"  # a pool of replica actors
    INPROCESS = "inprocess"  # one verifier in the front door
    PROCESS = "process"  # one verifier in a process of its own beside the front door


@dataclass(frozen=True)
class ServerSettings:
    """The front door: what it serves and where, how it stops, and its metrics port."""

    target: str = setting("", 'model directory, .gguf file or cached hub id; empty: the embedded default')
    host: str = setting(DEFAULT_HOST, "interface to bind; 0.0.0.0 serves other hosts")
    port: int = setting(DEFAULT_PORT, "port to bind; 0 = any free port", ge=0, le=65535)
    backend: Backend = setting(Backend.RAY, "ray: a pool of replica actors; inprocess: one verifier inside the "
                                            "front door; process: one verifier in a process of its own beside the "
                                            "front door (gRPC off the model loop's interpreter)")
    direct_verify: bool = setting(True, "(ray) edges stream rounds straight to their replica's own port on the "
                                        "host")
    metrics_port: int = setting(9464, "Prometheus /metrics port; -1 = off, 0 = any free port", ge=-1, le=65535)
    metrics_host: str = setting(DEFAULT_HOST, "interface of /metrics")
    grace_s: float = setting(5.0, "on SIGTERM or SIGINT, calls in flight get this long to finish", ge=0)
    insecure: bool = setting(False, "allow plaintext on a non-loopback host (logged as a warning)")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class ServeConfig(Sections):
    """Everything `hybridspec cloud serve` needs, by concern: one flag per setting (cli/flags.py), and a
    YAML file may name a setting flat or under its section. Each section but `server` is what a
    component receives, handed on whole and declared beside it: `access` is every endpoint's
    `AccessSpec` (cloud/api/access.py), `pool` and `replica` the `PoolSpec`'s and `ReplicaSpec`'s
    settings (cloud/pool/specs.py), `limits` the replicas' `VerifierLimits`.
    `ServeConfig.of(max_context=2048)` builds one from flat names."""

    server: ServerSettings = ServerSettings()
    access: AccessSpec = AccessSpec()
    pool: PoolSettings = PoolSettings()
    replica: ReplicaSettings = ReplicaSettings()
    limits: VerifierLimits = VerifierLimits()

    def __post_init__(self) -> None:
        check_plaintext(self.server.host, self.access.tls.enabled, self.server.insecure, "the gRPC front door")

    def replica_spec(self, target: str) -> ReplicaSpec:
        """What each replica loads (`target` already resolved to a path or hub id)."""
        return ReplicaSpec(target, self.replica, self.limits)

    def replica_endpoint(self) -> ReplicaEndpoint | None:
        """The endpoint each Ray replica serves its sessions' rounds on, on the front door's interface
        with its access rules; None without direct_verify (rounds then go through the front door)."""
        if not self.server.direct_verify:
            return None
        from .api.server import ReplicaEndpoint  # gRPC: only once a pool is built

        return ReplicaEndpoint(self.server.host, self.access)

    def pool_spec(self, target: str) -> PoolSpec:
        """The Ray pool this config describes."""
        return PoolSpec(self.replica_spec(target), self.pool)
