"""`hybridspec netem`: the user-space link emulator between edges and the cloud."""
from __future__ import annotations

import asyncio
import signal
import sys
import threading

from ..common.config import load_config
from ..netem.config import NetemConfig
from .flags import add_config_flags, config_overrides


def register(sub) -> None:
    """Add the `netem` command."""
    n = sub.add_parser("netem", help="relay TCP (gRPC) through an emulated network link",
                       description="Shapes each direction of every relayed TCP connection: one-way delay, "
                                   "jitter without reordering, a bandwidth cap, late (\"lost\") chunks and "
                                   "periodic stalls. --delay-ms D adds D ms each way (RTT + 2D); --up-*/--down-* "
                                   "flags override one direction (up = towards --upstream). --backend tc shapes "
                                   "the upstream port with the kernel's netem qdisc instead of relaying.")
    n.add_argument("--config", help="YAML file of NetemConfig keys; flags override it")
    add_config_flags(n.add_argument_group("settings (NetemConfig keys)"), NetemConfig)
    n.set_defaults(run=run_netem)


def run_netem(args) -> int:
    """Relay (or shape with tc) until SIGINT/SIGTERM, then print what crossed the link."""
    from ..netem.config import describe
    from ..netem.relay import LinkEmulator

    config = load_config(NetemConfig, args.config, config_overrides(args, NetemConfig))
    spec = config.link_spec()
    if config.backend == "tc":
        return _shape_with_tc(config, spec)

    async def serve() -> LinkEmulator:
        link = LinkEmulator(spec, config.upstream, config.listen, config.seed)
        address = await link.start()
        print(f"hybridspec netem relaying {address} -> {config.upstream} "
              f"(up: {describe(spec.up)}; down: {describe(spec.down)})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await link.stop()
        return link

    link = asyncio.run(serve())
    c = link.counters
    print(f"hybridspec netem stopped: {c.connections} connections, {c.up_bytes} bytes up, {c.down_bytes} bytes down",
          file=sys.stderr)
    return 0


def _shape_with_tc(config, spec) -> int:
    """Put netem on the device until SIGINT/SIGTERM, then take it off."""
    from ..netem.config import describe
    from ..netem.tc import TcLink

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with TcLink(spec, config.upstream, config.dev):
        print(f"hybridspec netem shaping {config.upstream}'s port on {config.dev} with tc netem "
              f"(up: {describe(spec.up)}; down: {describe(spec.down)}); edges connect to {config.upstream}",
              flush=True)
        stop.wait()
    print(f"hybridspec netem stopped: tc netem taken off {config.dev}", file=sys.stderr)
    return 0
