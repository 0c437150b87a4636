"""`hybridspec netem`: the user-space link emulator between edges and the cloud."""
from __future__ import annotations

import asyncio
import signal
import sys
import threading

from ..common.protocol.channel import DEFAULT_CLOUD_ADDRESS
from ..netem.profiles import PROFILES


def register(sub) -> None:
    """Add the `netem` command."""
    n = sub.add_parser("netem", help="relay TCP (gRPC) through an emulated network link",
                       description="Shapes each direction of every relayed TCP connection: one-way delay, "
                                   "jitter without reordering, a bandwidth cap, late (\"lost\") chunks and "
                                   "periodic stalls. --delay-ms D adds D ms each way (RTT + 2D); --up-*/--down-* "
                                   "flags override one direction (up = towards --upstream). --backend tc shapes "
                                   "the upstream port with the kernel's netem qdisc instead of relaying.")
    n.add_argument("--config", help="YAML file of NetemConfig keys")
    n.add_argument("--listen", help="HOST:PORT edges connect to (default 127.0.0.1:50052)")
    n.add_argument("--upstream", help=f"HOST:PORT of the cloud front door (default {DEFAULT_CLOUD_ADDRESS})")
    for prefix in ("", "up-", "down-"):
        which = f" ({prefix[:-1]} only)" if prefix else " (each direction)"
        n.add_argument(f"--{prefix}delay-ms", type=float, help=f"one-way delay{which}")
        n.add_argument(f"--{prefix}jitter-ms", type=float, help=f"delay varies by ± this{which}")
        n.add_argument(f"--{prefix}bandwidth-mbps", type=float, help=f"bandwidth cap, 0 = none{which}")
        n.add_argument(f"--{prefix}loss-pct", type=float, help=f"%% of chunks one 200 ms RTO late{which}")
        n.add_argument(f"--{prefix}stall-ms", type=float, help=f"stall length{which}")
        n.add_argument(f"--{prefix}stall-every-s", type=float, help=f"stall period{which}")
    n.add_argument("--profile", help="a named link preset: " + ", ".join(PROFILES) + " (docs/experiments.md cites "
                   "their sources); --up-*/--down-* flags still override one direction")
    n.add_argument("--trace", help="replay a recorded latency trace (`ping -D` output or t_s,rtt_ms lines) in place "
                   "of the delay keys; each direction gets half the RTT in force")
    n.add_argument("--backend", choices=("relay", "tc"),
                   help="relay (default): a user-space TCP relay on --listen; tc: the kernel's netem qdisc on "
                        "--dev for --upstream's port (root, sch_netem); edges then connect to --upstream itself")
    n.add_argument("--dev", help="the device --backend tc shapes (default lo; on a NIC run it on both hosts)")
    n.add_argument("--seed", type=int, help="seed for jitter and loss")
    n.set_defaults(run=run_netem)


def run_netem(args) -> int:
    """Relay (or shape with tc) until SIGINT/SIGTERM, then print what crossed the link."""
    from ..common.config import load_config
    from ..netem.config import CONFIG_KEYS, NetemConfig, describe
    from ..netem.relay import LinkEmulator

    config = load_config(NetemConfig, args.config, {k: getattr(args, k) for k in CONFIG_KEYS})
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
