"""`edge serve` under load against `edge generate` as a CLI process, on the embedded pair.

    python bench/serve_load.py [--concurrency 1 4 8] [--repeats 4] [--tokens 64] [--out docs/serve]

Starts `hybridspec cloud serve` (a 1-replica Ray pool) on the second core and `hybridspec edge
serve` on the first, one torch thread each, as if on two hosts; both with the embedded default
models. Then, per concurrency c, `repeats` rounds of c simultaneous streamed chat completions
(greedy, `--tokens` tokens, the official OpenAI client, a different prompt each): time to first
token (request sent → first content chunk) and tokens/s (all completion tokens of the round / its
wall time, and per request). The baseline is what a user without the server runs: `hybridspec edge
generate --stream` as a new process per prompt on the edge core, timed from spawn to its first
byte of text (start-up included) and to exit, with the tokens/s of its own generation from its
summary line. Means with 95 % t intervals go to OUT/results.md, results.json and results.png.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai
from hybridspec.cli.serve_cmd import parse_ready_line
from hybridspec.common.models.embedded import resolve
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from harness import REFERENCE, figure, save_figure, series, start_cloud, stop_cloud, t_interval, two_hosts, write_json

HYBRIDSPEC = [sys.executable, "-m", "hybridspec.cli.main"]
SUMMARY = re.compile(r"^\[?(\d+) tokens.*?([\d.]+) tokens/s", re.MULTILINE)


def ci95(xs: list[float]) -> dict:
    """Mean, its 95 % t interval half-width, and n."""
    mean, half = t_interval(xs)
    return {"mean": mean, "ci95": half, "n": len(xs)}


def start_edge_serve(cloud: str, concurrency: int) -> tuple[subprocess.Popen, str, float]:
    """`edge serve` (on this process's cores); returns the process, its base URL and seconds until ready."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([*HYBRIDSPEC, "edge", "serve", "--cloud", cloud, "--port", "0", "--torch-threads", "1",
                             "--max-concurrent", str(concurrency)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    base = parse_ready_line(line)
    if base is None:
        proc.kill()
        raise SystemExit(f"edge serve did not start: {line!r} {proc.stderr.read()[-2000:]}")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # drain: a full pipe would block it
    return proc, base, time.perf_counter() - t0


def one_request(client: openai.OpenAI, model: str, prompt: str, tokens: int) -> dict:
    """One streamed greedy chat completion: time to first content, tokens, wall time."""
    t0 = time.perf_counter()
    first = None
    completion = 0
    chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in chunks:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            completion = chunk.usage.completion_tokens
    wall = time.perf_counter() - t0
    return {"ttft_s": first, "tokens": completion, "wall_s": wall, "tokens_per_s": completion / wall}


def serve_round(client: openai.OpenAI, model: str, prompts: list[str], tokens: int) -> dict:
    """len(prompts) requests at once; the round's aggregate tokens/s and each request's numbers."""
    results: list[dict] = [{}] * len(prompts)

    def run(i: int) -> None:
        results[i] = one_request(client, model, prompts[i], tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens_per_s": sum(r["tokens"] for r in results) / wall, "requests": results}


def cli_run(cloud: str, prompt: str, tokens: int) -> dict:
    """`edge generate --stream` as a fresh process (on this process's cores): spawn → first text byte,
    spawn → exit."""
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
    # The exit status is kept, not enforced: the text and the summary line are what is measured.
    return {"ttft_s": first, "wall_s": wall, "tokens": n, "tokens_per_s": n / wall, "generation_tokens_per_s": rate,
            "returncode": proc.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("docs/serve"))
    args = parser.parse_args()
    if two_hosts()[0] is None:
        raise SystemExit("needs two cores: one for the edge, one for the cloud")
    # This process goes on the edge core: `edge serve`, the CLI runs and the clients (the device's apps) inherit it.
    cloud, address = start_cloud({"target": str(resolve("", "target")), "torch_threads": 1})
    serve = None
    try:
        serve, base, ready_s = start_edge_serve(address, max(args.concurrency))
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        print(f"edge serve ready in {ready_s:.1f} s (start-up and warm-up), model {model}", file=sys.stderr)
        rows: dict = {"serve": {c: [] for c in args.concurrency}, "cli": [], "serve_ready_s": ready_s,
                      "loadavg_before": os.getloadavg()[0]}
        # Repeats interleave every configuration, so load from elsewhere on the machine hits all alike.
        for r in range(args.repeats):
            for c in args.concurrency:
                prompts = [FREEFORM_PROMPTS[(r * c + i) % len(FREEFORM_PROMPTS)] for i in range(c)]
                rows["serve"][c].append(serve_round(client, model, prompts, args.tokens))
                print(f"serve c={c} round {r}: {rows['serve'][c][-1]['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
            rows["cli"].append(cli_run(address, FREEFORM_PROMPTS[r % len(FREEFORM_PROMPTS)], args.tokens))
            print(f"cli run {r}: first text after {rows['cli'][-1]['ttft_s']:.2f} s", file=sys.stderr)
        rows["loadavg_after"] = os.getloadavg()[0]  # this run's own load is about 2; more is other work
    finally:
        if serve is not None:
            serve.terminate()
            serve.wait(timeout=60)
        stop_cloud(cloud)
    summary = summarise(rows, args)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "results.json", {"summary": summary, "raw": rows})
    (args.out / "results.md").write_text(report(summary, args))
    plot(summary, args.out / "results.png")
    print(report(summary, args))


def summarise(rows: dict, args) -> dict:
    """Means and intervals per concurrency, and for the CLI."""
    serve = {}
    for c, rounds in rows["serve"].items():
        requests = [q for rnd in rounds for q in rnd["requests"]]
        serve[c] = {"ttft_s": ci95([q["ttft_s"] for q in requests]),
                    "tokens_per_s": ci95([rnd["tokens_per_s"] for rnd in rounds]),
                    "request_tokens_per_s": ci95([q["tokens_per_s"] for q in requests]),
                    "tokens": statistics.fmean(q["tokens"] for q in requests)}
    cli = rows["cli"]
    return {"serve": serve, "serve_ready_s": rows["serve_ready_s"],
            "loadavg": [rows["loadavg_before"], rows["loadavg_after"]],
            "cli": {k: ci95([run[k] for run in cli]) for k in ("ttft_s", "wall_s", "tokens_per_s",
                                                                 "generation_tokens_per_s")},
            "cli_aborted_exits": sum(run["returncode"] != 0 for run in cli),
            "tokens": args.tokens, "repeats": args.repeats}


def _fmt(x: dict, digits: int = 2) -> str:
    return f"{x['mean']:.{digits}f} ± {x['ci95']:.{digits}f}"


def report(s: dict, args) -> str:
    """The Markdown table of the results."""
    lines = [
        "# `edge serve` under load vs `edge generate` (embedded pair, this machine)",
        "",
        (f"Greedy streamed chat completions of {args.tokens} tokens; edge and cloud on separate cores, one torch "
         f"thread each; {args.repeats} rounds per row; mean ± 95 % t interval. Reproduce: "
         f"`python bench/serve_load.py --concurrency {' '.join(map(str, args.concurrency))} "
         f"--repeats {args.repeats} --tokens {args.tokens}`."),
        "",
        "| client | concurrent requests | time to first token (s) | tokens/s (all requests) | tokens/s per request |",
        "|---|---|---|---|---|",
    ]
    for c, row in s["serve"].items():
        lines.append(f"| `edge serve` + OpenAI client | {c} | {_fmt(row['ttft_s'])} | {_fmt(row['tokens_per_s'], 1)} | "
                     f"{_fmt(row['request_tokens_per_s'], 1)} |")
    cli = s["cli"]
    lines += [(f"| `edge generate --stream`, a new process each | 1 | {_fmt(cli['ttft_s'])} (spawn → first text) | "
               f"{_fmt(cli['tokens_per_s'], 1)} (spawn → exit) | {_fmt(cli['generation_tokens_per_s'], 1)} "
               "(its own generation) |"),
              "",
              (f"`edge serve` was ready {s['serve_ready_s']:.1f} s after it was started (loading, connecting, the "
               "warm-up generation); that cost is paid once per server, not per request."), "",
              (f"{s['cli_aborted_exits']} of {s['repeats']} `edge generate` runs exited with a non-zero status "
               "after printing their text and summary (a crash at interpreter exit, reported); their times count."
               if s["cli_aborted_exits"] else ""), "",
              (f"The machine's 1-minute load average was {s['loadavg'][0]:.1f} before and {s['loadavg'][1]:.1f} "
               "after the run (the run itself keeps both cores busy: about 2)."), ""]
    return "\n".join(lines)


def plot(s: dict, out: Path) -> None:
    """Time to first token and tokens/s against concurrency, the CLI as reference lines."""
    cs = list(s["serve"])
    fig, (left, right) = figure(2, figsize=(10, 4))
    for ax, key, title in ((left, "ttft_s", "time to first token (s)"), (right, "tokens_per_s", "tokens/s")):
        means = [s["serve"][c][key]["mean"] for c in cs]
        errs = [s["serve"][c][key]["ci95"] for c in cs]
        series(ax, 0, cs, means, errs, label="edge serve (all requests)")
        if key == "tokens_per_s":
            per = [s["serve"][c]["request_tokens_per_s"]["mean"] for c in cs]
            series(ax, 1, cs, per, label="edge serve (per request)")
        cli = s["cli"][key]
        ax.axhline(cli["mean"], linestyle=":", label="edge generate CLI (start-up included)", **REFERENCE)
        ax.set_xlabel("concurrent requests")
        ax.set_xticks(cs)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    save_figure(fig, out)


if __name__ == "__main__":
    main()
