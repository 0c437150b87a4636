"""`edge serve` under guidellm, an off-the-shelf OpenAI-compatible load generator: hybrid against
cloud-only with the same client, the same synthetic requests and guidellm's own metrics.

    python bench/guidellm_edge.py [--guidellm /tmp/guidellm-venv/bin/guidellm]
        [--modes hybrid cloud-only] [--profiles synchronous concurrent@2 concurrent@4] [--seconds 40]
        [--prompt-tokens 64] [--output-tokens 64] [--rtt-ms 0] [--out /tmp/guidellm-edge]

guidellm lives in a venv of its own (its pins are not this project's; docs/serve/guidellm.md). This
script starts `hybridspec cloud serve` (one replica, the default llama.cpp engine) on the second
core and, per mode, `hybridspec edge serve` on the first, one thread each, as the demo pins them.
Modes: `hybrid` (the default drafter and policy), `always-draft` (the same with
`--no-cloud-only-switch`) and `cloud-only` (the baseline). With `--rtt-ms` > 0 the edge reaches the
cloud through `hybridspec netem`, and the cloud verifies through its front door only, so every round
crosses the emulated link. guidellm itself is not pinned: on two cores nothing is left for it.
Each profile is one `guidellm run` with a JSON report; OUT gets those reports, results.json (the
metrics per mode and profile), results.md (the tables) and the servers' logs.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybridspec.cli.serve_cmd import parse_ready_line
from hybridspec.cloud.process import stop_cloud_process
from hybridspec.common.models.embedded import resolve
from harness import (CLOUD_CORE, EDGE_CORE, cpu_model, pin_child, start_cloud, stop_cloud, two_hosts, usable_cores,
                     write_json)

HYBRIDSPEC = [sys.executable, "-m", "hybridspec.cli.main"]
# `edge serve` flags per mode: the default policy (drafts only while that is predicted to pay, else
# lets the cloud decode alone), drafting every round whatever the prediction, and the baseline.
MODES = {"hybrid": [], "always-draft": ["--no-cloud-only-switch"], "cloud-only": ["--cloud-only"]}
NETEM_READY = "hybridspec netem relaying "
# guidellm's report keys, the status it summarises them over in its own console tables (latencies of
# successful requests, rates of all), and the statistic shown.
METRICS = {
    "req_s": ("requests_per_second", "total", "mean"),
    "out_tok_s": ("output_tokens_per_second", "total", "mean"),
    "out_tok_per_req": ("output_token_count", "successful", "mean"),
    "ttft_p50_ms": ("time_to_first_token_ms", "successful", "median"),
    "ttft_p95_ms": ("time_to_first_token_ms", "successful", "p95"),
    "itl_p50_ms": ("inter_token_latency_ms", "successful", "median"),
    "itl_p95_ms": ("inter_token_latency_ms", "successful", "p95"),
    "latency_p50_s": ("request_latency", "successful", "median"),
    "latency_p95_s": ("request_latency", "successful", "p95"),
}
# What the edge did with those tokens, from its own /metrics (docs/serve.md): summed over label sets.
EDGE_COUNTERS = {
    "completion": "hybridspec_edge_completion_tokens_total",
    "drafted": "hybridspec_edge_spec_decode_num_draft_tokens_total",
    "accepted": "hybridspec_edge_spec_decode_num_accepted_tokens_total",
    "cloud_only": "hybridspec_edge_cloud_only_tokens_total",
}


@dataclass(frozen=True)
class Profile:
    """One guidellm load profile: `synchronous`, `concurrent@N` (N streams) or `constant@R` (R requests/s)."""

    kind: str
    value: float | None = None

    @classmethod
    def parse(cls, text: str) -> Profile:
        kind, _, value = text.partition("@")
        if kind == "synchronous" and not value:
            return cls(kind)
        if kind in ("concurrent", "constant") and value:
            return cls(kind, float(value))
        raise argparse.ArgumentTypeError(f"{text!r}: synchronous, concurrent@N or constant@RATE")

    @property
    def name(self) -> str:
        return self.kind if self.value is None else f"{self.kind}@{self.value:g}"

    def guidellm_arg(self, warmup_s: float) -> str:
        """The `--profile` value guidellm 0.8 takes; its measurement window opens warmup_s seconds in
        (requests that end before that are left out; those running across it are kept)."""
        if self.kind == "concurrent":
            return f"kind=concurrent,streams={int(self.value)},warmup={warmup_s:g}"
        if self.kind == "constant":
            return f"kind=constant,rate={self.value:g},warmup={warmup_s:g}"
        return f"kind=synchronous,warmup={warmup_s:g}"


def read_ready(proc: subprocess.Popen, parse: Callable[[str], str | None], what: str, log: Path) -> str:
    """The address a child prints on its ready line (stdout); exit with its log's tail if it dies first."""
    assert proc.stdout is not None
    for line in proc.stdout:
        address = parse(line)
        if address is not None:
            return address
    proc.wait()
    raise SystemExit(f"{what} exited ({proc.returncode}) before it was ready: "
                     f"{log.read_text()[-2000:] if log.exists() else ''}")


def start_netem(upstream: str, rtt_ms: float, logs: Path) -> tuple[subprocess.Popen, str]:
    """`hybridspec netem` adding rtt_ms of round trip (half each way) in front of the cloud."""
    log = logs / "netem.log"
    proc = subprocess.Popen([*HYBRIDSPEC, "netem", "--listen", "127.0.0.1:0", "--upstream", upstream,
                             "--delay-ms", f"{rtt_ms / 2:g}"],
                            stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    address = read_ready(proc, lambda line: line[len(NETEM_READY):].split()[0] if line.startswith(NETEM_READY)
                         else None, "netem", log)
    return proc, address


def start_edge(cloud: str, mode: str, cores: set[int] | None, logs: Path) -> tuple[subprocess.Popen, str, float]:
    """`edge serve` in this mode on a free port; returns it, its base URL and seconds until it was ready
    (load, connect, warm-up generation)."""
    log = logs / f"edge-{mode}.log"
    t0 = time.perf_counter()
    proc = subprocess.Popen([*HYBRIDSPEC, "edge", "serve", "--cloud", cloud, "--port", "0",
                             "--torch-threads", "1" if cores else "0", *MODES[mode]],
                            stdout=subprocess.PIPE, stderr=log.open("w"), text=True, preexec_fn=pin_child(cores))
    base = read_ready(proc, parse_ready_line, f"edge serve ({mode})", log)
    return proc, base, time.perf_counter() - t0


def stop(proc: subprocess.Popen | None, timeout_s: float = 60) -> None:
    """Stop a server this bench started, if it is still running (SIGTERM, then kill)."""
    if proc is not None and proc.poll() is None:
        stop_cloud_process(proc, timeout_s)


def stop_group(proc: subprocess.Popen, timeout_s: float = 10) -> None:
    """SIGTERM the process group `proc` leads (nothing if it is gone), SIGKILL what is left after timeout_s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader: a zombie would keep the group alive for killpg
            os.killpg(proc.pid, 0)  # raises ProcessLookupError once the group is empty
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def served_model(base: str) -> str:
    """The model id `edge serve` answers to (GET /v1/models)."""
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as reply:
        return json.load(reply)["data"][0]["id"]


def edge_counters(base: str) -> dict[str, float]:
    """EDGE_COUNTERS' values now, from the edge's Prometheus text."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    totals = dict.fromkeys(EDGE_COUNTERS, 0.0)
    names = {name: key for key, name in EDGE_COUNTERS.items()}
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        key = names.get(series.split("{")[0])
        if key is not None:
            totals[key] += float(value)
    return totals


def guidellm_command(args, base: str, model: str, profile: Profile, report: Path) -> list[str]:
    """One `guidellm run`: synthetic prompts of fixed length, tokenised with the target's own tokenizer
    from its local directory (nothing is fetched from the hub), streamed chat completions."""
    return [args.guidellm, "run",
            "--backend", f"kind=openai_http,target={base},model={model}",
            "--tokenizer", f"kind=huggingface_auto,model={resolve('', 'target')}",
            "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
            "--profile", profile.guidellm_arg(args.warmup_s),
            "--constraint", f"kind=max_duration,seconds={args.seconds:g}",
            "--output", f"kind=json,path={report}",
            "--disable-progress"]


def guidellm_env() -> dict[str, str]:
    """Offline, and one worker process: its default of up to ten would crowd two cores for a few
    requests per second that one asyncio process sends on time."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1"}


def run_guidellm(args, base: str, model: str, mode: str, profile: Profile) -> dict:
    """Run one profile; returns its row: METRICS, request counts, what the edge did with the tokens
    (shares of the completion tokens over the whole profile, warm-up included), and the CPU seconds
    guidellm spent (on two shared cores the load generator's own cost is part of the picture)."""
    report = args.out / f"{mode}-{profile.name}.json"
    log = args.out / "logs" / f"guidellm-{mode}-{profile.name}.log"
    cmd = guidellm_command(args, base, model, profile, report)
    # The servers are children too, but not reaped until they stop: this delta is guidellm's alone.
    before, counted = resource.getrusage(resource.RUSAGE_CHILDREN), edge_counters(base)
    with log.open("w") as out:
        # A session of its own: guidellm spawns processes, and an interrupted run must stop them all.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=guidellm_env(), start_new_session=True)
        try:
            returncode = proc.wait()
        finally:
            stop_group(proc)
    after, edge = resource.getrusage(resource.RUSAGE_CHILDREN), edge_counters(base)
    if returncode != 0 or not report.exists():
        raise SystemExit(f"guidellm failed ({returncode}) for {mode} {profile.name}: {log.read_text()[-3000:]}")
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    edge = {key: edge[key] - counted[key] for key in EDGE_COUNTERS}
    tokens = max(edge["completion"], 1)
    return {"mode": mode, "profile": profile.name, "command": cmd, "guidellm_cpu_s": cpu_s, "edge": edge,
            "accepted_share": edge["accepted"] / tokens, "cloud_only_share": edge["cloud_only"] / tokens,
            "acceptance": edge["accepted"] / edge["drafted"] if edge["drafted"] else None,
            **summarise(json.loads(report.read_text()))}


def summarise(report: dict) -> dict:
    """guidellm's standard metrics of a one-benchmark report (the shape guidellm 0.8 writes)."""
    metrics = report["benchmarks"][0]["metrics"]
    row = {}
    for key, (name, status, stat) in METRICS.items():
        summary = metrics[name][status]
        row[key] = summary["percentiles"][stat] if stat.startswith("p") else summary[stat]
    totals = metrics["request_totals"]
    row.update(successful=totals["successful"], incomplete=totals["incomplete"], errored=totals["errored"])
    return row


def table(rows: list[dict]) -> str:
    """guidellm's metrics of the rows as a Markdown table."""
    lines = ["| mode | profile | requests/s | output tokens/s | output tokens/request | TTFT p50 / p95 (ms) | "
             "ITL p50 / p95 (ms) | request latency p50 / p95 (s) | requests ok / incomplete / errored |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['profile']} | {r['req_s']:.2f} | {r['out_tok_s']:.1f} | "
                     f"{r['out_tok_per_req']:.1f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f} | "
                     f"{r['itl_p50_ms']:.1f} / {r['itl_p95_ms']:.1f} | "
                     f"{r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f} | "
                     f"{r['successful']} / {r['incomplete']} / {r['errored']} |")
    return "\n".join(lines)


def edge_table(rows: list[dict]) -> str:
    """What the edge did per row (its /metrics) and what guidellm cost, as a Markdown table."""
    lines = ["| mode | profile | completion tokens | drafted and accepted | decoded by the cloud alone | "
             "draft acceptance | guidellm CPU (s) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        acceptance = "–" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        lines.append(f"| {r['mode']} | {r['profile']} | {r['edge']['completion']:.0f} | {r['accepted_share']:.0%} | "
                     f"{r['cloud_only_share']:.0%} | {acceptance} | {r['guidellm_cpu_s']:.1f} |")
    return "\n".join(lines)


def markdown(meta: dict, rows: list[dict]) -> str:
    """results.md: the setting, then the table."""
    link = f"through `hybridspec netem` at {meta['rtt_ms']:g} ms RTT" if meta["rtt_ms"] else "over loopback"
    return "\n".join([
        "# `edge serve` under guidellm: hybrid vs cloud-only",
        "",
        f"{meta['guidellm_version']}; {meta['cpu']}, {meta['cores']} cores; {meta['pinning']}; edge to cloud "
        f"{link}. Synthetic chat prompts of {meta['prompt_tokens']} tokens asking for {meta['output_tokens']}, "
        f"greedy, streamed; {meta['seconds']:g} s per profile, guidellm's measurement window opening "
        f"{meta['warmup_s']:g} s in (requests that end before it are left out). `edge serve` was ready after "
        + ", ".join(f"{s:.1f} s ({m})" for m, s in meta["ready_s"].items()) + ".",
        "",
        f"Reproduce: `{meta['command']}`",
        "",
        table(rows),
        "",
        "What the edge did with the completion tokens of each profile (its `/metrics`, warm-up included), "
        "and guidellm's own CPU time (start-up included):",
        "",
        edge_table(rows),
        "",
        f"Load average (1 min) before / after: {meta['loadavg'][0]:.2f} / {meta['loadavg'][1]:.2f}.",
        ""])


def interrupt(*_) -> None:
    """SIGINT and SIGTERM unwind main, whose `finally` stops every server (set explicitly: a shell
    starts background jobs with SIGINT ignored, and Python would keep ignoring it)."""
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--guidellm", default="/tmp/guidellm-venv/bin/guidellm", help="guidellm's executable")
    parser.add_argument("--profiles", type=Profile.parse, nargs="+",
                        default=[Profile("synchronous"), Profile("concurrent", 2), Profile("concurrent", 4)],
                        help="synchronous, concurrent@N or constant@RATE, each a guidellm run "
                             "(default: synchronous concurrent@2 concurrent@4)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=["hybrid", "cloud-only"])
    parser.add_argument("--seconds", type=float, default=40, help="length of each profile")
    parser.add_argument("--warmup-s", type=float, default=5,
                        help="open guidellm's measurement window this many seconds into a profile, past "
                             "its own start-up (requests that end before it are left out, those running "
                             "across it kept)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rtt-ms", type=float, default=0, help="> 0: put hybridspec netem between edge and cloud")
    parser.add_argument("--out", type=Path, default=Path("/tmp/guidellm-edge"),
                        help="guidellm's JSON reports, results.json, results.md and the servers' logs")
    args = parser.parse_args()
    version = subprocess.run([args.guidellm, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    edge_cores, cloud_cores = two_hosts()
    meta = {"guidellm_version": version, "cpu": cpu_model(), "cores": len(usable_cores()),
            "pinning": (f"cloud on core {CLOUD_CORE}, edge on core {EDGE_CORE}, one thread each; guidellm unpinned"
                        if edge_cores else "unpinned (one core)"),
            "rtt_ms": args.rtt_ms, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
            "seconds": args.seconds, "warmup_s": args.warmup_s, "command": "python " + " ".join(sys.argv),
            "ready_s": {}, "loadavg": [os.getloadavg()[0]]}
    rows: list[dict] = []
    cloud = netem = edge = None
    try:
        overrides: dict = {"torch_threads": 1} if cloud_cores else {}
        if args.rtt_ms:
            # Rounds must cross the emulated link: direct verify would send them to the replica's own port.
            overrides["direct_verify"] = False
        cloud, address = start_cloud(overrides, pin_edge=False)  # guidellm runs unpinned
        if args.rtt_ms:
            netem, address = start_netem(address, args.rtt_ms, logs)
        for mode in args.modes:
            edge, base, meta["ready_s"][mode] = start_edge(address, mode, edge_cores, logs)
            model = served_model(base)
            print(f"edge serve ({mode}) on {base}, ready in {meta['ready_s'][mode]:.1f} s", file=sys.stderr)
            for profile in args.profiles:
                rows.append(run_guidellm(args, base, model, mode, profile))
                print(table(rows[-1:]).splitlines()[-1], file=sys.stderr)
            stop(edge)
            edge = None
    except KeyboardInterrupt:
        print("interrupted: stopping the servers", file=sys.stderr)
        raise SystemExit(130)
    finally:
        stop(edge)
        stop(netem)
        if cloud is not None:
            stop_cloud(cloud)
    meta["loadavg"].append(os.getloadavg()[0])
    write_json(args.out / "results.json", {"meta": meta, "rows": rows})
    (args.out / "results.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
