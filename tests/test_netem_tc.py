"""The tc netem backend: the commands it builds, and either a real shaped round trip (a kernel with
sch_netem, inside a throwaway network namespace) or a one-line refusal (a kernel without it)."""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml

from hybridspec.common.config import ConfigError
from hybridspec.lab.spec import load_spec
from hybridspec.netem.shaping import DirectionSpec, LinkSpec
from hybridspec.netem.tc import TcError, TcLink, probe, tc_commands
from hybridspec.netem.trace import parse_trace

NETNS = os.geteuid() == 0 and shutil.which("unshare") and shutil.which("tc")
REASON = probe() if NETNS else "needs root, unshare and tc"


def test_commands_shape_only_the_port_each_way():
    spec = LinkSpec(up=DirectionSpec(delay_ms=20, jitter_ms=4, bandwidth_mbps=6.3, loss_pct=0.1),
                    down=DirectionSpec(delay_ms=30))
    commands = [" ".join(c) for c in tc_commands(spec, 50051)]
    assert commands[:3] == ["tc qdisc add dev lo root handle 1: prio bands 5",
                            "tc qdisc add dev lo parent 1:4 handle 40: netem delay 20ms 4ms loss 0.1% rate 6.3mbit",
                            "tc qdisc add dev lo parent 1:5 handle 50: netem delay 30ms"]
    filters = commands[3:]
    assert len(filters) == 4  # IPv4 and IPv6, each direction
    assert sum("dport 50051 0xffff flowid 1:4" in f for f in filters) == 2  # to the cloud: up
    assert sum("sport 50051 0xffff flowid 1:5" in f for f in filters) == 2  # from the cloud: down
    assert all(" protocol 6 0xff " in f for f in filters)  # TCP only


@pytest.mark.parametrize("spec, fragment", [
    (LinkSpec.symmetric(stall_ms=10, stall_every_s=1), "stall"),
    (LinkSpec.symmetric(trace=parse_trace("0,10\n", "x")), "trace")])
def test_what_netem_cannot_do_is_refused_before_touching_a_device(spec, fragment):
    with pytest.raises(TcError, match=fragment):
        tc_commands(spec, 50051)
    with pytest.raises(TcError, match="port"):
        tc_commands(LinkSpec(), 70000)


def test_a_remote_upstream_on_loopback_and_a_trace_under_tc_are_refused(tmp_path):
    with pytest.raises(TcError, match="--dev"):
        TcLink(LinkSpec.symmetric(delay_ms=5), "10.0.0.2:50051")  # refused before any tc command runs
    trace = tmp_path / "t.csv"
    trace.write_text("0,10\n")
    spec = tmp_path / "tc.yaml"
    spec.write_text(yaml.safe_dump({"netem_backend": "tc", "grid": {"link": [f"trace:{trace}"]},
                                    "strategies": [{"name": "c", "kind": "cloud_only"}]}))
    with pytest.raises(ConfigError, match="cannot replay"):
        load_spec(spec)


ROUND_TRIP = textwrap.dedent("""
    import json, socket, subprocess, threading
    from hybridspec.netem.shaping import LinkSpec
    from hybridspec.netem.tc import TcLink
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    def echo():
        conn, _ = server.accept()
        while data := conn.recv(64):
            conn.sendall(data)
    threading.Thread(target=echo, daemon=True).start()
    def qdiscs():
        return subprocess.run(["tc", "-s", "qdisc", "show", "dev", "lo"], capture_output=True, text=True,
                              check=True).stdout
    with TcLink(LinkSpec.symmetric(delay_ms=25), f"127.0.0.1:{port}"):
        sock = socket.create_connection(("127.0.0.1", port)); sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(10):
            sock.sendall(b"x")
            assert sock.recv(64) == b"x"
        during = qdiscs()
    print(json.dumps({"during": during, "after": qdiscs()}))
""")
# One netem qdisc per direction as `tc -s qdisc show` lists it, with the packets it has sent.
NETEM_SENT = re.compile(r"qdisc netem (40|50): [^\n]*delay 25(?:\.0)?ms[^\n]*\n\s*Sent \d+ bytes (\d+) pkt")


@pytest.mark.skipif(REASON is not None, reason=f"tc netem unavailable here: {REASON}")
def test_tc_netem_shapes_a_real_round_trip_and_comes_off_again():
    """Every message of a real round trip passes the kernel's netem qdisc of its direction, set to the
    spec's delay (the kernel keeps the time; the commands are checked exactly above); on leaving,
    nothing of ours is left on the device."""
    r = subprocess.run(["unshare", "--net", sys.executable, "-c", ROUND_TRIP], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    shown = json.loads(r.stdout)
    sent = {handle: int(packets) for handle, packets in NETEM_SENT.findall(shown["during"])}
    assert sent.keys() == {"40", "50"} and min(sent.values()) >= 10, shown["during"]  # up, down: 10 messages each
    assert "netem" not in shown["after"] and "prio" not in shown["after"], shown["after"]


@pytest.mark.slow
@pytest.mark.skipif(not NETNS or REASON is None, reason="this kernel has tc netem (the other test runs)")
def test_without_sch_netem_the_cli_and_an_experiment_refuse_in_one_line(tmp_path):
    r = subprocess.run(["unshare", "--net", sys.executable, "-m", "hybridspec.cli.main", "netem", "--backend", "tc",
                        "--upstream", "127.0.0.1:50051", "--delay-ms", "10"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "sch_netem" in r.stderr and "relay" in r.stderr
    spec = tmp_path / "tc.yaml"
    spec.write_text(yaml.safe_dump({"prompts": ["hi"], "netem_backend": "tc",
                                    "strategies": [{"name": "c", "kind": "cloud_only"}]}))
    r = subprocess.run([sys.executable, "-m", "hybridspec.cli.main", "experiment", "run", str(spec), "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "netem_backend tc" in r.stderr and "sch_netem" in r.stderr
    assert not (tmp_path / "out" / "results.jsonl").exists()
