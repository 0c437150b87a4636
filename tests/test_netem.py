"""The link emulator: shaping maths exactly; over real sockets, the relay holding each direction's bytes
for exactly what its spec says, read on a virtual clock (the relay's `Timing`), so no assertion depends
on how fast this machine is; the CLI relaying the spec it was given."""
import asyncio
import contextlib
import random
import signal
import socket
import socketserver
import statistics
import subprocess
import sys
import threading

import pytest

from hybridspec.netem.config import NetemConfig, describe
from hybridspec.netem.relay import BackgroundLink, Timing
from hybridspec.netem.shaping import RTO_S, DirectionSpec, LinkSpec, Shaper


# ---- shaping (pure) -------------------------------------------------------------------------------

def test_delay_and_bandwidth_add_up():
    shaper = Shaper(DirectionSpec(delay_ms=30, bandwidth_mbps=8))  # 1 MB/s
    assert shaper.release_time(0.0, 1000) == pytest.approx(0.001 + 0.030)
    # The second chunk queues behind the first on the serialiser.
    assert shaper.release_time(0.0, 1000) == pytest.approx(0.002 + 0.030)
    # An idle link starts serialising at once.
    assert shaper.release_time(5.0, 1000) == pytest.approx(5.001 + 0.030)


def test_jitter_never_reorders_and_keeps_the_mean():
    shaper = Shaper(DirectionSpec(delay_ms=50, jitter_ms=40), random.Random(0))
    arrivals = [i * 0.001 for i in range(5000)]
    releases = [shaper.release_time(t, 10) for t in arrivals]
    assert releases == sorted(releases)
    spaced = Shaper(DirectionSpec(delay_ms=50, jitter_ms=40), random.Random(1))
    delays = [spaced.release_time(i * 1.0, 10) - i * 1.0 for i in range(5000)]  # far apart: no holding back
    assert min(delays) >= 0.010 - 1e-9 and max(delays) <= 0.090 + 1e-9
    assert statistics.mean(delays) == pytest.approx(0.050, abs=0.002)


def test_loss_delays_about_the_stated_share_by_one_rto():
    shaper = Shaper(DirectionSpec(delay_ms=10, loss_pct=10), random.Random(0))
    delays = [shaper.release_time(i * 1.0, 10) - i * 1.0 for i in range(10000)]
    late = [d for d in delays if d > 0.011]
    assert all(d == pytest.approx(0.010 + RTO_S) for d in late)
    assert 0.08 < len(late) / len(delays) < 0.12  # 10% ± 2%: > 6 standard deviations at n = 10^4


def test_stall_holds_chunks_until_it_ends():
    shaper = Shaper(DirectionSpec(stall_ms=100, stall_every_s=1.0), origin=0.0)
    assert shaper.release_time(0.5, 10) == pytest.approx(0.5)
    assert shaper.release_time(0.95, 10) == pytest.approx(1.0)  # inside [0.9, 1.0): waits for 1.0
    assert shaper.release_time(1.2, 10) == pytest.approx(1.2)


@pytest.mark.parametrize("bad", [dict(delay_ms=-1), dict(loss_pct=100), dict(stall_ms=10),
                                 dict(stall_ms=2000, stall_every_s=1), dict(bandwidth_mbps=float("inf"))])
def test_bad_specs_are_refused(bad):
    with pytest.raises(ValueError):
        DirectionSpec(**bad)


# ---- the relay over real sockets ----------------------------------------------------------------

class VirtualClock:
    """The relay's time in a test: it stands still until the relay waits for a chunk's release, then
    moves on by exactly that wait. Time read on it is the schedule the relay kept, free of the real
    clock's scheduling noise; a relay that sent a chunk early, late or not at all shows up exactly."""

    def __init__(self) -> None:
        self.t = 0.0

    async def _sleep(self, seconds: float) -> None:
        self.t += seconds
        await asyncio.sleep(0)

    @property
    def timing(self) -> Timing:
        return Timing(now=lambda: self.t, sleep=self._sleep)


class _Echo(socketserver.BaseRequestHandler):
    clock: VirtualClock | None = None  # when set, the (virtual) times at which each message arrived
    arrivals: list[float] = []

    def handle(self):
        while data := self.request.recv(65536):
            if self.clock is not None:
                self.arrivals.append(self.clock.t)
            self.request.sendall(data)


class _Sink(socketserver.BaseRequestHandler):
    def handle(self):
        total = 0
        while data := self.request.recv(65536):
            total += len(data)
        self.request.sendall(str(total).encode())


def _serve(handler):
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.server_address[1]}"


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _echoed(address: str, message: bytes = b"x" * 32) -> bytes:
    """Send `message` once over a new connection and read back as many bytes."""
    with _connect(address) as sock:
        sock.sendall(message)
        got = b""
        while len(got) < len(message) and (data := sock.recv(64)):
            got += data
    return got


@pytest.fixture
def stamped(monkeypatch):
    """A virtual clock for the relay, and the echo server's record of when messages reached it."""
    clock = VirtualClock()
    monkeypatch.setattr(_Echo, "clock", clock)
    monkeypatch.setattr(_Echo, "arrivals", [])
    return clock


@pytest.fixture(scope="module")
def echo():
    server, address = _serve(_Echo)
    yield address
    server.shutdown()


def test_a_round_trip_takes_the_configured_delay_each_way(echo, stamped):
    with BackgroundLink(LinkSpec.symmetric(delay_ms=20), echo, timing=stamped.timing) as link:
        for i in range(3):  # on an idle link every round trip is the same
            assert _echoed(link.address) == b"x" * 32
            assert _Echo.arrivals[i] == pytest.approx(i * 0.040 + 0.020) and stamped.t == pytest.approx((i + 1) * 0.040)


def test_each_direction_has_its_own_delay(echo, stamped):
    spec = LinkSpec(up=DirectionSpec(delay_ms=30), down=DirectionSpec(delay_ms=5))
    with BackgroundLink(spec, echo, timing=stamped.timing) as link:
        assert _echoed(link.address) == b"x" * 32
    assert _Echo.arrivals == [pytest.approx(0.030)]  # up: towards the upstream server
    assert stamped.t == pytest.approx(0.035)


def test_throughput_is_the_bandwidth_cap(stamped):
    server, sink = _serve(_Sink)
    payload = b"\0" * 500_000  # 4 Mbit: one second at 4 Mbps, however the relay's reads split it
    try:
        with BackgroundLink(LinkSpec(up=DirectionSpec(bandwidth_mbps=4)), sink, timing=stamped.timing) as link:
            with _connect(link.address) as sock:
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
                assert int(sock.recv(64)) == len(payload)
    finally:
        server.shutdown()
    assert stamped.t == pytest.approx(1.0)


def test_outage_cuts_connections_and_recovery_lets_new_ones_through(echo):
    with BackgroundLink(LinkSpec(), echo) as link:
        sock = _connect(link.address)
        sock.sendall(b"ping")
        assert sock.recv(16) == b"ping"
        link.set_down(True)  # in effect when it returns
        with pytest.raises(OSError):
            sock.sendall(b"x" * 65536)
            for _ in range(10):
                if not sock.recv(16):
                    raise ConnectionResetError("closed by the link")
        sock.close()
        link.set_down(False)
        assert _echoed(link.address) == b"x" * 32


def test_a_connection_accepted_while_the_link_is_cut_is_cut_too(echo, monkeypatch):
    """Regression: the relay accepted a connection, then cut the link while it was still connecting
    upstream; the cut closed only the connections it knew, and this one went on relaying through the
    outage."""
    from hybridspec.netem import relay
    with BackgroundLink(LinkSpec(), echo) as link:
        connect = relay.asyncio.open_connection

        async def cut_meanwhile(*args, **kwargs):
            streams = await connect(*args, **kwargs)
            link.link.set_down(True)  # on the relay's loop, as the cut lands between accept and relay
            return streams

        monkeypatch.setattr(relay.asyncio, "open_connection", cut_meanwhile)
        sock = _connect(link.address)
        with pytest.raises(OSError):
            sock.sendall(b"ping")
            if not sock.recv(16):
                raise ConnectionResetError("closed by the link")
        sock.close()


@contextlib.contextmanager
def _cli_relay(*flags: str):
    """`hybridspec netem` as a subprocess on a free port: (its address, what it says it relays, the
    process). On leaving, SIGTERM must stop it with exit 0; its stderr is then in proc.stderr_text."""
    proc = subprocess.Popen([sys.executable, "-m", "hybridspec.cli.main", "netem", "--listen", "127.0.0.1:0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("hybridspec netem relaying"), line + proc.stderr.read()
        yield line.split()[3], line.split(" (", 1)[1].rstrip().rstrip(")"), proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        proc.stderr_text = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def relays(**config) -> str:
    """What `hybridspec netem` says it relays with for these NetemConfig keys."""
    spec = NetemConfig(**config).link_spec()
    return f"up: {describe(spec.up)}; down: {describe(spec.down)}"


def test_the_cli_relays_with_the_configured_delay_and_stops_cleanly(echo):
    with _cli_relay("--upstream", echo, "--delay-ms", "15", "--down-delay-ms", "5") as (address, shaping, proc):
        assert shaping == "up: 15 ms; down: 5 ms"  # the spec it relays with (the relay's tests: its delays)
        assert _echoed(address) == b"x" * 32
    assert "1 connections, 32 bytes up, 32 bytes down" in proc.stderr_text


def test_the_cli_names_a_bad_value():
    r = subprocess.run([sys.executable, "-m", "hybridspec.cli.main", "netem", "--upstream", "127.0.0.1:9",
                        "--loss-pct", "150"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "loss_pct" in r.stderr


def test_profiles_are_complete_and_cited():
    from hybridspec.netem.profiles import PROFILES

    assert set(PROFILES) >= {"lan", "metro-fibre", "lte", "5g", "satellite-geo", "wifi-lossy"}
    for name, preset in PROFILES.items():
        spec = preset.link_spec()  # valid for the shaper
        assert spec.up.delay_ms + spec.down.delay_ms == pytest.approx(preset.rtt_ms), name
        assert preset.source and ("illustrative" in preset.source or "physics" in preset.source
                                  or any(c.isdigit() for c in preset.source)), name


def test_the_cli_relays_a_profile_and_refuses_one_mixed_with_a_delay(echo):
    from hybridspec.netem.profiles import PROFILES

    r = subprocess.run([sys.executable, "-m", "hybridspec.cli.main", "netem", "--upstream", echo, "--profile", "lte",
                        "--delay-ms", "3"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "drop delay_ms" in r.stderr
    # metro fibre: a 2 ms round trip, no loss, tight jitter; --up-delay-ms overrides one direction
    with _cli_relay("--upstream", echo, "--profile", "metro-fibre", "--up-delay-ms", "20") as (address, shaping, _):
        assert shaping == relays(profile="metro-fibre", up_delay_ms=20)
        assert shaping.startswith("up: 20 ms") and f"down: {PROFILES['metro-fibre'].rtt_ms / 2:g} ms" in shaping
        assert _echoed(address) == b"x" * 32


# ---- recorded latency traces ----------------------------------------------------------------------

PING_D = """PING edge.example (192.0.2.7) 56(84) bytes of data.
[1700000000.000000] 64 bytes from 192.0.2.7: icmp_seq=1 ttl=57 time=40.0 ms
[1700000000.500000] 64 bytes from 192.0.2.7: icmp_seq=2 ttl=57 time=41.5 ms
[1700000000.700000] From 192.0.2.1 icmp_seq=3 Destination Host Unreachable
[1700000000.900000] no answer yet for icmp_seq=3
[1700000001.000000] 64 bytes from 192.0.2.7: icmp_seq=4 ttl=57 time=160 ms
[1700000001.500000] 64 bytes from 192.0.2.7: icmp_seq=5 ttl=57 time<1 ms

--- edge.example ping statistics ---
4 packets transmitted, 3 received, 25% packet loss, time 1500ms
rtt min/avg/max/mdev = 40.0/80.5/160/56.2 ms
"""


def test_a_ping_trace_replays_as_a_step_function_that_loops():
    from hybridspec.netem.trace import parse_trace

    trace = parse_trace(PING_D, "ping.txt")
    # Lost and unreachable probes leave the last RTT in place; `time<1 ms` is the middle of [0, 1).
    assert trace.times_s == (0.0, 0.5, 1.0, 1.5) and trace.rtt_ms == (40.0, 41.5, 160.0, 0.5)
    assert trace.period_s == pytest.approx(2.0)  # the last sample holds for the median spacing
    assert [trace.rtt_at(t) for t in (0.0, 0.49, 0.5, 0.8, 1.2, 1.7, 2.0, 2.6)] == \
        [40.0, 40.0, 41.5, 41.5, 160.0, 0.5, 40.0, 41.5]
    assert parse_trace("t_s,rtt_ms\n0,10\n2.5,30  # a comment\n", "x").rtt_at(3) == 30.0  # a header is skipped


@pytest.mark.parametrize("text, fragment", [
    ("64 bytes from 192.0.2.7: icmp_seq=1 ttl=57 time=40.0 ms\n", "ping -D"),
    ("0,10\nhello\n", "x:2"),
    ("1,10\n0,20\n", "x:2: sample times must increase"),
    ("0,10\n0,20\n", "x:2: sample times must increase"),  # else a zero-length loop
    ("0,10\n1e999,20\n", "finite"),
    ("0,-5\n", "x:1: .*>= 0"),
    ("# nothing\n", "no RTT samples")])
def test_bad_traces_name_the_line(text, fragment):
    from hybridspec.netem.trace import parse_trace

    with pytest.raises(ValueError, match=fragment):
        parse_trace(text, "x")


def test_a_trace_sets_half_the_rtt_in_force_each_way_and_keeps_bytes_in_order():
    from hybridspec.netem.trace import parse_trace

    shaper = Shaper(DirectionSpec(trace=parse_trace("0,200\n1,20\n", "x")), origin=0.0)
    assert shaper.release_time(0.1, 10) == pytest.approx(0.2)
    assert shaper.release_time(1.05, 10) == pytest.approx(1.06)
    # A chunk that enters just after the RTT drops may not overtake the one before it.
    slow = Shaper(DirectionSpec(trace=parse_trace("0,200\n1,20\n", "x")), origin=0.0)
    assert slow.release_time(0.99, 10) == pytest.approx(1.09)
    assert slow.release_time(1.0, 10) == pytest.approx(1.09)
    with pytest.raises(ValueError, match="delay_ms"):
        DirectionSpec(delay_ms=5, trace=parse_trace("0,10\n", "x"))


@pytest.mark.slow
def test_the_cli_replays_a_trace_file(echo, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("0,60\n")  # one sample: 60 ms for as long as the link runs
    r = subprocess.run([sys.executable, "-m", "hybridspec.cli.main", "netem", "--upstream", echo, "--trace",
                        str(trace), "--delay-ms", "5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "drop delay_ms" in r.stderr
    with _cli_relay("--upstream", echo, "--trace", str(trace)) as (address, shaping, _):
        assert shaping == relays(trace=str(trace)) and shaping.startswith("up: half the RTT of")
        assert _echoed(address) == b"x" * 32
