"""`edge serve` under load on the embedded pair, the cloud (a 1-replica Ray pool) on the second core and
`edge serve` on the first, one thread each, as if on two hosts.

openai compares the OpenAI client at each concurrency with `edge generate --stream` as a process per
prompt; guidellm runs one `guidellm run` per profile per mode, through `hybridspec netem` with --rtt-ms.
docs/serve.md has the method and the numbers.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hybridspec.cli.serve_cmd import parse_ready_line
from hybridspec.cloud.process import stop_cloud_process
from hybridspec.common.models.embedded import resolve
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from hybridspec.lab.stats import mean_ci
from harness import arguments, cpu_model, pin_child, start_cloud, stop_cloud, two_hosts, write_results

HYBRIDSPEC = [sys.executable, "-m", "hybridspec.cli.main"]
SUMMARY = re.compile(r"^\[?(\d+) tokens.*?([\d.]+) tokens/s", re.MULTILINE)
MODES = {"hybrid": [], "always-draft": ["--no-cloud-only-switch"], "cloud-only": ["--cloud-only"]}
NETEM_READY = "hybridspec netem relaying "
# guidellm 0.8's report keys: (metric, the requests it is summarised over, the statistic).
METRICS = {"req_s": ("requests_per_second", "total", "mean"), "out_tok_s": ("output_tokens_per_second", "total", "mean"),
           **{f"{short}_{p}_{unit}": (name, "successful", "median" if p == "p50" else p) for p in ("p50", "p95")
              for short, name, unit in (("ttft", "time_to_first_token_ms", "ms"), ("itl", "inter_token_latency_ms", "ms"),
                                        ("latency", "request_latency", "s"))}}
# What the edge did with the tokens, from its own /metrics (docs/serve.md), summed over label sets.
EDGE_COUNTERS = {"completion": "hybridspec_edge_completion_tokens_total",
                 "drafted": "hybridspec_edge_spec_decode_num_draft_tokens_total",
                 "accepted": "hybridspec_edge_spec_decode_num_accepted_tokens_total",
                 "cloud_only": "hybridspec_edge_cloud_only_tokens_total"}


def read_ready(proc: subprocess.Popen, parse, what: str, log: Path) -> str:
    """The address a child prints on its ready line; exit with its log's tail if it dies first."""
    for line in proc.stdout:
        address = parse(line)
        if address is not None:
            return address
    proc.wait()
    raise SystemExit(f"{what} exited ({proc.returncode}) before it was ready: "
                     f"{log.read_text()[-2000:] if log.exists() else ''}")


def start_edge(cloud: str, flags: list[str], cores: set[int] | None, log: Path) -> tuple[subprocess.Popen, str, float]:
    """`edge serve` with these flags on a free port (pinned to `cores`, else inheriting this process's);
    returns it, its base URL and the seconds until it was ready (load, connect, warm-up generation)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([*HYBRIDSPEC, "edge", "serve", "--cloud", cloud, "--port", "0", "--torch-threads", "1",
                             *flags], stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
                            preexec_fn=pin_child(cores))
    base = read_ready(proc, parse_ready_line, "edge serve", log)
    return proc, base, time.perf_counter() - t0


def stop(proc: subprocess.Popen | None) -> None:
    """Stop a server this bench started, if it is still running (SIGTERM, then kill)."""
    if proc is not None and proc.poll() is None:
        stop_cloud_process(proc, 60)


def ci95(xs: list[float]) -> dict:
    """Mean, its 95 % t interval half-width, and n."""
    e = mean_ci(xs)
    return {"mean": e.value, "ci95": e.half_width, "n": e.n}


def one_request(client, model: str, prompt: str, tokens: int) -> dict:
    """One streamed greedy chat completion: time to first content, tokens, wall time."""
    t0 = time.perf_counter()
    first, completion = None, 0
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            completion = chunk.usage.completion_tokens
    wall = time.perf_counter() - t0
    return {"ttft_s": first, "tokens": completion, "wall_s": wall, "tokens_per_s": completion / wall}


def serve_round(client, model: str, prompts: list[str], tokens: int) -> dict:
    """len(prompts) requests at once; the round's aggregate tokens/s and each request's numbers."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda prompt: one_request(client, model, prompt, tokens), prompts))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens_per_s": sum(r["tokens"] for r in results) / wall, "requests": results}


def cli_run(cloud: str, prompt: str, tokens: int) -> dict:
    """`edge generate --stream` as a fresh process: spawn → first text byte, spawn → exit."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([*HYBRIDSPEC, "edge", "generate", "--cloud", cloud, "--chat", "--prompt", prompt,
                             "--max-new-tokens", str(tokens), "--torch-threads", "1", "--stream"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    first = time.perf_counter() - t0
    proc.stdout.read()
    err = proc.stderr.read().decode()
    proc.wait()
    wall = time.perf_counter() - t0
    summary = SUMMARY.search(err)
    if summary is None:
        raise SystemExit(f"edge generate failed ({proc.returncode}): {err[-2000:]}")
    n, rate = int(summary.group(1)), float(summary.group(2))
    return {"ttft_s": first, "wall_s": wall, "tokens": n, "tokens_per_s": n / wall, "generation_tokens_per_s": rate,
            "returncode": proc.returncode}


def openai_load(args) -> None:
    """Rounds of concurrent requests per concurrency and CLI runs, interleaved; the tables."""
    import openai

    if two_hosts()[0] is None:
        raise SystemExit("needs two cores: one for the edge, one for the cloud")
    args.out.mkdir(parents=True, exist_ok=True)
    # This process goes on the edge core: `edge serve`, the CLI runs and the clients (the device's apps) inherit it.
    cloud, address = start_cloud({"target": str(resolve("", "target")), "torch_threads": 1})
    serve = None
    try:
        log = Path(tempfile.gettempdir()) / f"hybridspec-edge-serve-{os.getpid()}.log"
        serve, base, ready_s = start_edge(address, ["--max-concurrent", str(max(args.concurrency))], None, log)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        rows: dict = {"serve": {c: [] for c in args.concurrency}, "cli": [], "serve_ready_s": ready_s,
                      "loadavg_before": os.getloadavg()[0]}
        for r in range(args.repeats):  # every configuration in each repeat: drift hits all alike
            for c in args.concurrency:
                prompts = [FREEFORM_PROMPTS[(r * c + i) % len(FREEFORM_PROMPTS)] for i in range(c)]
                rows["serve"][c].append(serve_round(client, model, prompts, args.tokens))
            rows["cli"].append(cli_run(address, FREEFORM_PROMPTS[r % len(FREEFORM_PROMPTS)], args.tokens))
            print(f"repeat {r + 1} of {args.repeats} done", file=sys.stderr)
        rows["loadavg_after"] = os.getloadavg()[0]
    finally:
        stop(serve)
        stop_cloud(cloud)
    serve_rows = {}
    for c, rounds in rows["serve"].items():
        requests = [q for rnd in rounds for q in rnd["requests"]]
        serve_rows[c] = {"ttft_s": ci95([q["ttft_s"] for q in requests]),
                         "tokens_per_s": ci95([rnd["tokens_per_s"] for rnd in rounds]),
                         "request_tokens_per_s": ci95([q["tokens_per_s"] for q in requests]),
                         "tokens": statistics.fmean(q["tokens"] for q in requests)}
    summary = {"serve": serve_rows, "serve_ready_s": rows["serve_ready_s"],
               "loadavg": [rows["loadavg_before"], rows["loadavg_after"]],
               "cli": {k: ci95([run[k] for run in rows["cli"]])
                       for k in ("ttft_s", "wall_s", "tokens_per_s", "generation_tokens_per_s")},
               "cli_aborted_exits": sum(run["returncode"] != 0 for run in rows["cli"]),
               "tokens": args.tokens, "repeats": args.repeats}
    write_results(args.out, {"summary": summary, "raw": rows}, openai_markdown(summary, args))


def openai_markdown(s: dict, args) -> str:
    """The Markdown table of the results."""
    def fmt(x: dict, digits: int = 2) -> str:
        return f"{x['mean']:.{digits}f} ± {x['ci95']:.{digits}f}"

    lines = ["# `edge serve` under load vs `edge generate` (embedded pair, this machine)", "",
             f"Greedy streamed chat completions of {args.tokens} tokens; edge and cloud on separate cores, one torch "
             f"thread each; {args.repeats} rounds per row; mean ± 95 % t interval. Reproduce: "
             f"`python bench/serve_load.py openai --concurrency {' '.join(map(str, args.concurrency))} "
             f"--repeats {args.repeats} --tokens {args.tokens}`.", "",
             "| client | concurrent requests | time to first token (s) | tokens/s (all requests) | tokens/s per request |",
             "|---|---|---|---|---|"]
    for c, row in s["serve"].items():
        lines.append(f"| `edge serve` + OpenAI client | {c} | {fmt(row['ttft_s'])} | {fmt(row['tokens_per_s'], 1)} | "
                     f"{fmt(row['request_tokens_per_s'], 1)} |")
    cli = s["cli"]
    lines += [f"| `edge generate --stream`, a new process each | 1 | {fmt(cli['ttft_s'])} (spawn → first text) | "
              f"{fmt(cli['tokens_per_s'], 1)} (spawn → exit) | {fmt(cli['generation_tokens_per_s'], 1)} "
              "(its own generation) |", "",
              f"`edge serve` was ready {s['serve_ready_s']:.1f} s after it was started (paid once per server). "
              f"{s['cli_aborted_exits']} of {s['repeats']} `edge generate` runs exited non-zero after their text. "
              f"Load average before / after: {s['loadavg'][0]:.1f} / {s['loadavg'][1]:.1f} (the run itself: about 2).",
              ""]
    return "\n".join(lines)


def guidellm_profile(text: str) -> str:
    """A profile name checked: synchronous, concurrent@N or constant@RATE."""
    kind, _, value = text.partition("@")
    if (kind == "synchronous" and not value) or (kind in ("concurrent", "constant") and value.replace(".", "").isdigit()):
        return text
    raise ValueError(f"{text!r}: synchronous, concurrent@N or constant@RATE")


def profile_arg(profile: str, warmup_s: float) -> str:
    """The `--profile` value guidellm 0.8 takes; its measurement window opens warmup_s seconds in."""
    kind, _, value = profile.partition("@")
    key = {"synchronous": "", "concurrent": f",streams={int(float(value or 0))}", "constant": f",rate={value}"}[kind]
    return f"kind={kind}{key},warmup={warmup_s:g}"


def edge_counters(base: str) -> dict[str, float]:
    """EDGE_COUNTERS' values now, from the edge's Prometheus text."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    totals = dict.fromkeys(EDGE_COUNTERS, 0.0)
    names = {name: key for key, name in EDGE_COUNTERS.items()}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        key = names.get(name.split("{")[0])
        if key is not None:
            totals[key] += float(value)
    return totals


def stop_group(proc: subprocess.Popen, timeout_s: float = 10) -> None:
    """SIGTERM the process group `proc` leads, SIGKILL what is left after timeout_s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader: a zombie would keep the group alive for killpg
            os.killpg(proc.pid, 0)  # raises ProcessLookupError once the group is empty
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_guidellm(args, base: str, model: str, mode: str, profile: str) -> dict:
    """One profile: guidellm's metrics, what the edge did with the completion tokens (warm-up included)
    and the CPU seconds guidellm spent (on two shared cores the load generator's cost is part of it)."""
    report = args.out / f"{mode}-{profile}.json"
    cmd = [args.guidellm, "run", "--backend", f"kind=openai_http,target={base},model={model}",
           "--tokenizer", f"kind=huggingface_auto,model={resolve('', 'target')}",  # local: nothing is fetched
           "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
           "--profile", profile_arg(profile, args.warmup_s), "--constraint", f"kind=max_duration,seconds={args.seconds:g}",
           "--output", f"kind=json,path={report}", "--disable-progress"]
    # Offline, and one worker process: its default of up to ten would crowd two cores.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    log = args.out / "logs" / f"guidellm-{mode}-{profile}.log"
    before, counted = resource.getrusage(resource.RUSAGE_CHILDREN), edge_counters(base)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode = proc.wait()
        finally:
            stop_group(proc)
    after, edge = resource.getrusage(resource.RUSAGE_CHILDREN), edge_counters(base)
    if returncode != 0 or not report.exists():
        raise SystemExit(f"guidellm failed ({returncode}) for {mode} {profile}: {log.read_text()[-3000:]}")
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    row = {"mode": mode, "profile": profile, "command": cmd,
           "guidellm_cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
           "edge": {key: edge[key] - counted[key] for key in EDGE_COUNTERS}}
    for key, (name, status, stat) in METRICS.items():
        summary = metrics[name][status]
        row[key] = summary["percentiles"][stat] if stat.startswith("p") else summary[stat]
    row.update({k: metrics["request_totals"][k] for k in ("successful", "incomplete", "errored")})
    return row


def guidellm_markdown(meta: dict, rows: list[dict]) -> str:
    """results.md: the setting, guidellm's metrics and what the edge did."""
    link = f"through `hybridspec netem` at {meta['rtt_ms']:g} ms RTT" if meta["rtt_ms"] else "over loopback"
    lines = ["# `edge serve` under guidellm", "",
             f"{meta['guidellm_version']}; {meta['cpu']}; edge to cloud {link}; synthetic chat prompts of "
             f"{meta['prompt_tokens']} tokens asking for {meta['output_tokens']}, greedy, streamed; {meta['seconds']:g} s "
             f"per profile, the window opening {meta['warmup_s']:g} s in. Reproduce: `{meta['command']}`", "",
             "| mode | profile | requests/s | output tokens/s | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) | latency "
             "p50 / p95 (s) | ok / incomplete / errored | drafted and accepted | by the cloud alone | guidellm CPU s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tokens = max(r["edge"]["completion"], 1)
        lines.append(f"| {r['mode']} | {r['profile']} | {r['req_s']:.2f} | {r['out_tok_s']:.1f} | "
                     f"{r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f} | {r['itl_p50_ms']:.1f} / {r['itl_p95_ms']:.1f} | "
                     f"{r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f} | {r['successful']} / {r['incomplete']} / "
                     f"{r['errored']} | {r['edge']['accepted'] / tokens:.0%} | {r['edge']['cloud_only'] / tokens:.0%} | "
                     f"{r['guidellm_cpu_s']:.1f} |")
    return "\n".join(lines) + "\n"


def guidellm_load(args) -> None:
    """Per mode, an `edge serve` and one guidellm run per profile."""
    version = subprocess.run([args.guidellm, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    for sig in (signal.SIGINT, signal.SIGTERM):  # unwind to `finally` (a shell's background job ignores SIGINT)
        signal.signal(sig, signal.default_int_handler)
    edge_cores, cloud_cores = two_hosts()
    meta = {"guidellm_version": version, "cpu": cpu_model(), "rtt_ms": args.rtt_ms, "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens, "seconds": args.seconds, "warmup_s": args.warmup_s,
            "command": "python " + " ".join(sys.argv), "ready_s": {}, "loadavg": [os.getloadavg()[0]]}
    rows: list[dict] = []
    cloud = netem = edge = None
    try:
        # With a link, rounds must cross it: direct verify would send them to the replica's own port.
        keys = {**({"torch_threads": 1} if cloud_cores else {}), **({"direct_verify": False} if args.rtt_ms else {})}
        cloud, address = start_cloud(keys, pin_edge=False)
        if args.rtt_ms:
            log = args.out / "logs" / "netem.log"
            netem = subprocess.Popen([*HYBRIDSPEC, "netem", "--listen", "127.0.0.1:0", "--upstream", address,
                                      "--delay-ms", f"{args.rtt_ms / 2:g}"], stdout=subprocess.PIPE,
                                     stderr=log.open("w"), text=True)
            address = read_ready(netem, lambda line: line[len(NETEM_READY):].split()[0]
                                 if line.startswith(NETEM_READY) else None, "netem", log)
        for mode in args.modes:
            edge, base, meta["ready_s"][mode] = start_edge(address, MODES[mode], edge_cores,
                                                           args.out / "logs" / f"edge-{mode}.log")
            with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as reply:
                model = json.load(reply)["data"][0]["id"]
            for profile in args.profiles:
                rows.append(run_guidellm(args, base, model, mode, profile))
                print(guidellm_markdown(meta, rows[-1:]).splitlines()[-1], file=sys.stderr)
            stop(edge)
            edge = None
    finally:
        stop(edge)
        stop(netem)
        if cloud is not None:
            stop_cloud(cloud)
    meta["loadavg"].append(os.getloadavg()[0])
    write_results(args.out, {"meta": meta, "rows": rows}, guidellm_markdown(meta, rows))


def main() -> None:
    parser = arguments(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    own = commands.add_parser("openai", help="the OpenAI client at 1, 4, 8 concurrent requests, and the CLI")
    own.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    own.add_argument("--repeats", type=int, default=4)
    own.add_argument("--tokens", type=int, default=64)
    own.add_argument("--out", type=Path, default=Path("docs/serve"))
    load = commands.add_parser("guidellm", help="guidellm's profiles against the default edge and cloud-only")
    load.add_argument("--guidellm", default="/tmp/guidellm-venv/bin/guidellm", help="guidellm's executable")
    load.add_argument("--modes", nargs="+", choices=list(MODES), default=["hybrid", "cloud-only"])
    load.add_argument("--profiles", type=guidellm_profile, nargs="+",
                      default=["synchronous", "concurrent@2", "concurrent@4"])
    load.add_argument("--seconds", type=float, default=40, help="length of each profile")
    load.add_argument("--warmup-s", type=float, default=5, help="guidellm's measurement window opens this far in")
    load.add_argument("--prompt-tokens", type=int, default=64)
    load.add_argument("--output-tokens", type=int, default=64)
    load.add_argument("--rtt-ms", type=float, default=0, help="> 0: hybridspec netem between edge and cloud")
    load.add_argument("--out", type=Path, default=Path("docs/serve/guidellm"))
    args = parser.parse_args()
    openai_load(args) if args.command == "openai" else guidellm_load(args)


if __name__ == "__main__":
    main()
