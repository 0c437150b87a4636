"""The suite's outputs: results.json (every number, with where and when it was measured), a markdown
table of the headline figures against their goals, and a plot of pass times and capacity."""
from __future__ import annotations

import json
from pathlib import Path

# The goals of the GPU issue the summary table reports against (issue: "The GPU verifier for real").
GOALS = {"t1_135m_ms": 1.5, "v_b1_135m": 1.1, "v_b64_135m": 1.3, "t1_8b_ms": 6.0, "v_b1_8b": 1.05,
         "capacity_a08": 2.5, "capacity_a06": 1.8}


def write_json(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


def _pass_ms(results: dict, shape: str, engine: str, b: int, m: int) -> float | None:
    rows = results.get("passes", {}).get(shape, {}).get(engine) or []
    return next((r["ms"] for r in rows if r["sessions"] == b and r["tokens"] == m), None)


def _fmt(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def headline(results: dict) -> list[tuple[str, str, str]]:
    """(figure, measured, goal) rows."""
    rows = []
    for shape, tag in (("smollm2-135m", "135m"), ("llama-3.1-8b", "8b")):
        t1 = _pass_ms(results, shape, "torch", 1, 1)
        if t1 is not None:
            rows.append((f"{shape}: t(1 session × 1 token), ms", _fmt(t1), f"≤ {GOALS[f't1_{tag}_ms']}"))
        for b in (1, 64):
            t5 = _pass_ms(results, shape, "torch", b, 5)
            tb1 = _pass_ms(results, shape, "torch", b, 1)
            goal = GOALS.get(f"v_b{b}_{tag}")
            if t5 and tb1 and goal:
                rows.append((f"{shape}: v = t(5)/t(1) at B = {b}", _fmt(t5 / tb1), f"≤ {goal}"))
    for key, value in results.get("exactness", {}).items():
        for kind in ("chains", "trees"):
            part = value.get(kind)
            if part:
                rows.append((f"exactness {key}: {kind}, differing / generated tokens",
                             f"{part['differing_tokens']} / {part['tokens']}", "0"))
    cap = results.get("capacity", {}).get("rows", [])
    most = max((r["edges"] for r in cap), default=0)
    for agree, goal in ((0.8, "capacity_a08"), (0.6, "capacity_a06")):
        for rtt in sorted({r["rtt_ms"] for r in cap}):
            base = next((r for r in cap if r["edges"] == most and r["rtt_ms"] == rtt and r["mode"] == "cloud-only"), None)
            hyb = next((r for r in cap if r["edges"] == most and r["rtt_ms"] == rtt and r.get("agree") == agree), None)
            if base and hyb and base["tokens_per_s"]:
                rows.append((f"capacity, {most} edges, RTT {rtt:g} ms, α = {agree}: hybrid ÷ cloud-only tokens/s",
                             _fmt(hyb["tokens_per_s"] / base["tokens_per_s"]), f"≥ {GOALS[goal]}"))
    return rows


def write_markdown(out: Path, results: dict) -> None:
    meta = results["meta"]
    lines = [f"# GPU suite: {meta['device_name']}", "",
             f"{meta['date']}, commit {meta['commit']}, torch {meta['torch']}, triton {meta.get('triton')}, "
             f"weights: random {meta['dtype']} (time depends on shape, not values); `{meta['command']}`", "",
             "| figure | measured | goal |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in headline(results)]
    if results.get("wide_tiles"):
        lines += ["", "Wide product tiles for passes over 64 rows (only where bit-identical to the narrow ones): " +
                  ", ".join(f"{shape} {'yes' if ok else 'no'}" for shape, ok in results["wide_tiles"].items())]
    for shape, engines in results.get("passes", {}).items():
        lines += ["", f"## Pass time, {shape} (ms, median; host work included)", ""]
        for engine, rows in engines.items():
            tokens = sorted({r["tokens"] for r in rows})
            lines += [f"**{engine}**", "", "| B \\ M | " + " | ".join(map(str, tokens)) + " |",
                      "|---" * (len(tokens) + 1) + "|"]
            for b in sorted({r["sessions"] for r in rows}):
                cells = [_fmt(_pass_ms(results, shape, engine, b, m)) for m in tokens]
                lines.append(f"| {b} | " + " | ".join(cells) + " |")
            lines.append("")
    for shape, rows in results.get("products", {}).items():
        lines += [f"## Matrix products, {shape} (ms, median; rows invariant: a row's bits at every row count)", "",
                  "| matrix | rows | Triton ms | cuBLAS ms | Triton GB/s of weights | Triton invariant | cuBLAS invariant |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['matrix']} ({r['n']}×{r['k']}) | {r['rows']} | {r['triton_ms']:.4f} | {r['cublas_ms']:.4f} | "
                  f"{r['weight_gb_per_s_triton']} | {r['triton_rows_invariant']} | {r['cublas_rows_invariant']} |"
                  for r in rows]
        lines.append("")
    cap = results.get("capacity", {}).get("rows", [])
    if cap:
        lines += ["## Capacity through gRPC", "", "| RTT ms | edges | mode | tokens/s | per edge | p95 step ms | "
                  "tokens/round | differing |", "|---|---|---|---|---|---|---|---|"]
        for r in cap:
            lines.append(f"| {r['rtt_ms']:g} | {r['edges']} | {r['mode']} | {_fmt(r['tokens_per_s'], 0)} | "
                         f"{_fmt(r['per_edge_tokens_per_s'], 1)} | {_fmt(r['p95_step_ms'], 1)} | "
                         f"{_fmt(r['tokens_per_round'])} | {r.get('differing_tokens', '')} |")
    if results.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in results["errors"]]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def plot(out: Path, results: dict) -> None:
    """Pass time against tokens per session (one panel per shape), and capacity against edges."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = results.get("passes", {})
    cap = results.get("capacity", {}).get("rows", [])
    panels = len(passes) + (1 if cap else 0)
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 4), squeeze=False)
    styles = {"torch": "-", "eager": "--"}  # "eager": the first engine, in the results of runs before its removal
    for ax, (shape, engines) in zip(axes[0], passes.items()):
        for engine, rows in engines.items():
            for b, marker in zip((1, 8, 32, 64), "os^D"):
                pts = sorted((r["tokens"], r["ms"], r["ms_min"], r["ms_max"]) for r in rows if r["sessions"] == b)
                if pts:
                    m, ms, lo, hi = zip(*pts)
                    ax.errorbar(m, ms, yerr=[[a - c for a, c in zip(ms, lo)], [d - a for a, d in zip(ms, hi)]],
                                linestyle=styles.get(engine, "-"), marker=marker, label=f"{engine} B={b}", capsize=2)
        ax.set(title=shape, xlabel="tokens per session (M)", ylabel="pass time (ms)", yscale="log")
        ax.legend(fontsize=6)
    if cap:
        ax = axes[0][-1]
        for (mode, rtt), marker in zip(sorted({(r["mode"], r["rtt_ms"]) for r in cap}), "os^Dv<>p"):
            pts = sorted((r["edges"], r["tokens_per_s"]) for r in cap if r["mode"] == mode and r["rtt_ms"] == rtt)
            ax.plot(*zip(*pts), marker=marker, linestyle="-" if rtt == 0 else "--", label=f"{mode}, RTT {rtt:g} ms")
        ax.set(title=f"capacity ({results['capacity'].get('shape')})", xlabel="edges",
               ylabel="committed tokens/s (one GPU)", xscale="log", yscale="log")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=120)
