"""The kernel's netem qdisc as the emulated link, where the kernel has it (sch_prio and sch_netem).

Only one TCP port's traffic is shaped: packets to the port (edge → cloud, "up") pass one netem
qdisc, packets from it ("down") another, and everything else on the device is untouched — Ray's own
traffic on the same host included. On loopback both directions leave through the same device, so one
host gets the whole link; on a NIC a qdisc shapes only what leaves it, so run the same command on
both hosts (each host's outgoing packets match one of the two filters).

It differs from the user-space relay (netem/relay.py) where the kernel is more real: a lost packet
is really dropped and TCP recovers it (fast retransmit or an RTO), and jitter may reorder packets.
It cannot stall the link or replay a trace; those settings are refused.
"""
from __future__ import annotations

import shutil
import subprocess

from ..common.errors import HybridSpecError
from .shaping import DirectionSpec, LinkSpec

BANDS = 5  # prio's three default bands take all other traffic; band 4 is up, band 5 is down


class TcError(HybridSpecError):
    """tc is missing, the kernel refused a qdisc, or the link cannot be expressed in netem."""


def netem_args(spec: DirectionSpec) -> list[str]:
    """The `netem ...` arguments of one direction."""
    if spec.stall_ms:
        raise TcError("tc netem cannot stall a link: use the relay backend for stall_ms")
    if spec.trace is not None:
        raise TcError("tc netem cannot replay a latency trace: use the relay backend")
    args = ["netem", "delay", f"{spec.delay_ms:g}ms"]
    if spec.jitter_ms:
        args.append(f"{spec.jitter_ms:g}ms")  # without a distribution netem draws uniformly in ± jitter
    if spec.loss_pct:
        args += ["loss", f"{spec.loss_pct:g}%"]
    if spec.bandwidth_mbps:
        args += ["rate", f"{spec.bandwidth_mbps:g}mbit"]
    return args


def tc_commands(spec: LinkSpec, port: int, dev: str = "lo") -> list[list[str]]:
    """The tc invocations that shape `port` on `dev`, in order."""
    if not 0 < port < 65536:
        raise TcError(f"port must be in 1..65535, got {port}")
    qdisc = ["tc", "qdisc", "add", "dev", dev]
    commands = [qdisc + ["root", "handle", "1:", "prio", "bands", str(BANDS)],
                qdisc + ["parent", "1:4", "handle", "40:", *netem_args(spec.up)],
                qdisc + ["parent", "1:5", "handle", "50:", *netem_args(spec.down)]]
    for protocol, match, priority in (("ip", "ip", "1"), ("ipv6", "ip6", "2")):
        for field, band in (("dport", "1:4"), ("sport", "1:5")):
            commands.append(["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", protocol, "prio", priority,
                             "u32", "match", match, field, str(port), "0xffff", "flowid", band])
    return commands


def clear_command(dev: str = "lo") -> list[str]:
    """Removes everything tc_commands added (and any other root qdisc of `dev`)."""
    return ["tc", "qdisc", "del", "dev", dev, "root"]


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [ln.strip() for ln in (result.stderr or result.stdout).splitlines() if ln.strip()]
        reason = lines[0] if lines else f"exit status {result.returncode}"
        hint = " (this kernel lacks the qdisc: `modprobe sch_prio sch_netem`, or use the relay backend)" \
            if "kind is unknown" in reason else ""
        raise TcError(f"`{' '.join(command[:6])} ...` failed: {reason}{hint}")


class TcLink:
    """netem on `dev` for the traffic of `upstream`'s port; edges connect to `upstream` itself.
    The same shape as relay.BackgroundLink: `.address`, `stop()`, a context manager."""

    def __init__(self, spec: LinkSpec, upstream: str, dev: str = "lo") -> None:
        if shutil.which("tc") is None:
            raise TcError("the tc backend needs `tc` (iproute2) on PATH")
        _, _, port = upstream.rpartition(":")
        if not port.isdigit():
            raise TcError(f"upstream must be HOST:PORT, got {upstream!r}")
        self.address = upstream
        self.dev = dev
        commands = tc_commands(spec, int(port), dev)  # refuses what netem cannot do before touching the device
        for i, command in enumerate(commands):
            try:
                _run(command)
            except TcError:
                if i:  # the root qdisc was ours: take it, and what hangs off it, back off
                    subprocess.run(clear_command(dev), capture_output=True)
                raise

    def stop(self) -> None:
        """Take the qdiscs (and filters) off the device."""
        subprocess.run(clear_command(self.dev), capture_output=True)

    def __enter__(self) -> TcLink:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def probe() -> str | None:
    """None if netem works here, else why not — tried in a throwaway network namespace, so the
    host's devices are never touched."""
    if shutil.which("tc") is None or shutil.which("unshare") is None:
        return "tc or unshare (util-linux) is not on PATH"
    root, netem = tc_commands(LinkSpec.symmetric(delay_ms=1), 9)[:2]
    script = f"ip link set lo up && {' '.join(root)} && {' '.join(netem)}"
    result = subprocess.run(["unshare", "--net", "sh", "-c", script], capture_output=True, text=True)
    if result.returncode == 0:
        return None
    lines = [ln.strip() for ln in result.stderr.splitlines() if ln.strip()]
    return lines[0] if lines else f"exit status {result.returncode}"
