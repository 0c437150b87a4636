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

import ipaddress
import shutil
import subprocess

from ..common.protocol.errors import HybridSpecError
from .relay import split_address
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
    args = ["netem", "delay", f"{_num(spec.delay_ms)}ms"]
    if spec.jitter_ms:  # without a distribution table the kernel draws uniformly in ± jitter
        args.append(f"{_num(spec.jitter_ms)}ms")
    if spec.loss_pct:
        args += ["loss", f"{_num(spec.loss_pct)}%"]
    if spec.bandwidth_mbps:
        args += ["rate", f"{_num(spec.bandwidth_mbps)}mbit"]  # tc's mbit is 10^6 bit/s, as the relay's
    return args


def _num(value: float) -> str:
    """A number as tc reads it, without float noise and without losing digits."""
    return f"{value:.12g}"


def tc_commands(spec: LinkSpec, port: int, dev: str = "lo") -> list[list[str]]:
    """The tc invocations that shape `port` on `dev`, in order."""
    if not 0 < port < 65536:
        raise TcError(f"port must be in 1..65535, got {port}")
    qdisc = ["tc", "qdisc", "add", "dev", dev]
    commands = [qdisc + ["root", "handle", "1:", "prio", "bands", str(BANDS)],
                qdisc + ["parent", "1:4", "handle", "40:", *netem_args(spec.up)],
                qdisc + ["parent", "1:5", "handle", "50:", *netem_args(spec.down)]]
    # TCP only; u32's fixed offsets assume no IPv4 options or IPv6 extension headers, as TCP on
    # loopback and ordinary routes has. One filter prio per protocol: a prio cannot mix them.
    for protocol, match, priority in (("ip", "ip", "1"), ("ipv6", "ip6", "2")):
        for field, band in (("dport", "1:4"), ("sport", "1:5")):
            commands.append(["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", protocol, "prio", priority,
                             "u32", "match", match, "protocol", "6", "0xff", "match", match, field, str(port),
                             "0xffff", "flowid", band])
    return commands


def clear_command(dev: str = "lo") -> list[str]:
    """Removes everything tc_commands added (and any other root qdisc of `dev`)."""
    return ["tc", "qdisc", "del", "dev", dev, "root"]


def _first_line(result: subprocess.CompletedProcess) -> str:
    """What a failed command said first, for a one-line error."""
    lines = [ln.strip() for ln in (result.stderr or result.stdout).splitlines() if ln.strip()]
    return lines[0] if lines else f"exit status {result.returncode}"


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        reason = _first_line(result)
        hint = ""
        if "kind is unknown" in reason or "Unknown filter" in reason:
            hint = " (this kernel lacks it: `modprobe -a sch_prio sch_netem cls_u32`, or use the relay backend)"
        elif "Exclusivity" in reason or "File exists" in reason:
            clear = " ".join(clear_command(command[4]))
            hint = f" (the device already has a root qdisc; a killed run may have left ours: `{clear}`)"
        raise TcError(f"`{' '.join(command[:6])} ...` failed: {reason}{hint}")


class TcLink:
    """netem on `dev` for the traffic of `upstream`'s port; edges connect to `upstream` itself.
    The same shape as relay.BackgroundLink: `.address`, `stop()`, a context manager."""

    def __init__(self, spec: LinkSpec, upstream: str, dev: str = "lo") -> None:
        if shutil.which("tc") is None:
            raise TcError("the tc backend needs `tc` (iproute2) on PATH")
        try:
            host, port = split_address(upstream)
        except ValueError as exc:
            raise TcError(str(exc)) from None
        if dev == "lo" and not _is_loopback(host):
            raise TcError(f"traffic to {upstream} does not cross lo: name the device it leaves by (--dev)")
        self.address = upstream
        self.dev = dev
        commands = tc_commands(spec, port, dev)  # refuses what netem cannot do before touching the device
        self._applied = False
        for i, command in enumerate(commands):
            try:
                _run(command)
            except BaseException:  # Ctrl-C half-way too: the root qdisc, once added, is ours to take off
                if i:
                    subprocess.run(clear_command(dev), capture_output=True)
                raise
        self._applied = True

    def stop(self) -> None:
        """Take the qdiscs (and filters) off the device, once."""
        if self._applied:
            self._applied = False
            subprocess.run(clear_command(self.dev), capture_output=True)

    def __enter__(self) -> TcLink:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def probe() -> str | None:
    """None if everything TcLink does works here, else why not — tried in a throwaway network
    namespace (which needs unshare and CAP_SYS_ADMIN), so the host's devices are never touched."""
    if shutil.which("tc") is None or shutil.which("unshare") is None:
        return "tc or unshare (util-linux) is not on PATH"
    commands = tc_commands(LinkSpec.symmetric(delay_ms=1, jitter_ms=0.5, bandwidth_mbps=100, loss_pct=0.1), 9)
    script = " && ".join(["ip link set lo up"] + [" ".join(c) for c in commands])
    result = subprocess.run(["unshare", "--net", "sh", "-c", script], capture_output=True, text=True)
    return None if result.returncode == 0 else _first_line(result)
