"""`hybridspec cloud serve`: the gRPC front door and the verifier pool behind it."""
from __future__ import annotations

import asyncio
import logging
import sys

from ..cloud.config import Backend, ServeConfig
from ..cloud.process import READY_PREFIX
from ..common.config import load_config
from .flags import add_config_flags, config_overrides


def register(sub) -> None:
    """Add the `cloud` command group."""
    cloud = sub.add_parser("cloud", help="run the cloud verifier pool")
    csub = cloud.add_subparsers(dest="cloud_command", required=True, metavar="ACTION")
    serve = csub.add_parser("serve", help="serve the target model until SIGINT/SIGTERM",
                            description="Flags override the --config file; with neither, the local CPU "
                                        "defaults apply (the values of deploy/local-cpu.yaml).")
    serve.add_argument("--config", help="YAML file of ServeConfig keys (see deploy/)")
    add_config_flags(serve.add_argument_group("settings (ServeConfig keys; flags override --config)"), ServeConfig)
    serve.set_defaults(run=run_serve)


def serve_config(args):
    """ServeConfig from its defaults, then --config, then the flags."""
    return load_config(ServeConfig, args.config, config_overrides(args, ServeConfig))


def run_serve(args) -> int:
    """Start the backend, then serve; prints one 'serving on HOST:PORT' line once SERVING."""
    config = serve_config(args)  # light: nothing heavy is imported until the backend starts
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # Before the models or a Ray cluster start; the real binds are checked again when they happen.
    server = config.server
    _check_ports({"host": server.host, "port": server.port, "metrics_host": server.metrics_host,
                  "metrics_port": server.metrics_port})
    _check_access(config)
    backend, what = _backend(config)

    def ready(running) -> None:
        metrics = f", metrics on {server.metrics_host}:{running.metrics_port}" if running.metrics_port else ""
        print(f"{READY_PREFIX}{server.host}:{running.port} ({what}{metrics})", flush=True)

    from ..cloud.api.server import serve_forever

    metrics_port = None if server.metrics_port < 0 else server.metrics_port
    asyncio.run(serve_forever(backend, server.host, server.port, server.grace_s, metrics_port, server.metrics_host,
                              ready, config.access))
    print("hybridspec verifier stopped", file=sys.stderr)
    return 0


def _check_ports(ports: dict) -> None:
    """PortUnavailable, naming the port, if the gRPC or (when on) the metrics port cannot be bound."""
    from ..cloud.api.ports import check_port

    if ports["port"] > 0:
        check_port(ports["host"], ports["port"], "gRPC front door")
    if ports["metrics_port"] > 0:
        check_port(ports["metrics_host"], ports["metrics_port"], "metrics HTTP server")


def _check_access(config) -> None:
    """ConfigError now, before anything slow starts, for a TLS or credentials file that cannot be used;
    warnings for a server reachable from the network without TLS or without tokens."""
    from ..cloud.api.access import Access
    from ..common.security.tls import check_plaintext, is_loopback

    access, server = config.access, config.server
    access.tls.check_files()
    Access(access)
    log = logging.getLogger("hybridspec.cloud")
    warning = check_plaintext(server.host, access.tls.enabled, server.insecure, "the gRPC front door")
    if warning:
        log.warning(warning)
    if not access.credentials and not is_loopback(server.host):
        log.warning("no --credentials: every client that reaches %s:%s may open sessions (limits apply per "
                    "address); see docs/security.md", server.host, server.port)


def _backend(config):
    """The backend the config asks for, and a few words describing it."""
    from ..cloud.engine.factory import pick_engine
    from ..common.models.embedded import resolve
    from ..common.models.sources import classify_model

    replica = config.replica
    target = resolve(config.server.target, "target")
    classify_model(target)  # fail here, in one line, before Ray replicas try to load it
    kind = pick_engine(target, replica.engine, replica.device, replica.dtype, config.limits.max_sessions)
    if config.server.backend is Backend.RAY:
        from ..cloud.pool.ray_pool import RayPool

        pool = RayPool(config.pool_spec(target), config.replica_endpoint())
        return pool, f"{target}, {kind} engine, {config.pool.replicas} Ray replica(s)"
    if config.server.backend is Backend.PROCESS:
        from ..cloud.pool.process_replica import process_pool

        pool = process_pool(config.replica_spec(target), config.pool.max_sessions_per_client,
                            config.pool.max_sessions_per_address, config.pool.replica_wait_s)
        return pool, f"{target}, {kind} engine, its own process"
    from ..cloud.pool.pool import inprocess_pool
    from ..cloud.pool.loading import load_verifier

    backend = inprocess_pool(load_verifier(config.replica_spec(target)), config.pool.max_sessions_per_client,
                             config.pool.max_sessions_per_address)
    return backend, f"{target}, {kind} engine, in-process"
