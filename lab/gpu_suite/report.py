"""The suite's outputs: results.json (every number, with where and when it was measured), a markdown
table of the headline figures against their goals, and a plot of pass times and capacity."""
from __future__ import annotations

import json
import math
from pathlib import Path

# The goals the summary table reports against (issue 53, "Capacity where the product pays"; an H100's,
# an H200 scales the memory-bound rows by bandwidth).
GOALS = {"t1_135m_ms": 1.2, "t1_8b_ms": 6.0, "ratio_64_8b": 1.35, "capacity_a08": 2.5, "capacity_a06": 1.8,
         "capacity_a08_rtt20": 1.8}
ENGINES = ("fused", "torch")  # the engine a headline reads: the current kernels, or a file's from before them


def write_json(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


def _pass_ms(results: dict, shape: str, engine: str, b: int, m: int) -> float | None:
    rows = results.get("passes", {}).get(shape, {}).get(engine) or []
    return next((r["ms"] for r in rows if r["sessions"] == b and r["tokens"] == m), None)


def _fmt(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def histogram_delta(before, after) -> dict | None:
    """What a histogram (telemetry HistogramSnapshot) counted between two snapshots."""
    if before is None or after is None:
        return None
    return {"bounds": list(after.bounds), "counts": [b - a for a, b in zip(before.counts, after.counts)]}


def hold_inputs(telemetry) -> dict | None:
    """What the replica's auto hold weighed (cloud/core/holding.py), in ms: a pass's fixed part and how soon
    nine in ten answered edges came back (None until measured)."""
    if telemetry is None:
        return None
    back = telemetry.return_s
    return {"pass_fixed": round(telemetry.pass_fixed_s * 1e3, 3),
            "return": round(back * 1e3, 3) if math.isfinite(back) else None}


def _hold(inputs: dict | None) -> str:
    if not inputs:
        return ""
    back = inputs["return"]
    return f"{inputs['pass_fixed']:.1f} / {'—' if back is None else f'{back:.1f}'}"


def _ratio(hyb: dict, base: dict) -> str:
    """hybrid ÷ cloud-only tokens/s, with the range the two 95 % intervals allow."""
    ratio = hyb["tokens_per_s"] / base["tokens_per_s"]
    lo_h, hi_h = hyb.get("tokens_per_s_95") or (None, None)
    lo_b, hi_b = base.get("tokens_per_s_95") or (None, None)
    if None in (lo_h, hi_h, lo_b, hi_b) or lo_b <= 0:
        return _fmt(ratio)
    return f"{ratio:.2f} ({lo_h / hi_b:.2f}–{hi_h / lo_b:.2f})"


def headline(results: dict) -> list[tuple[str, str, str]]:
    """(figure, measured, goal) rows."""
    rows = []
    for shape, tag in (("smollm2-135m", "135m"), ("llama-3.1-8b", "8b")):
        engines = [e for e in (*ENGINES, "split") if results.get("passes", {}).get(shape, {}).get(e)]
        for engine in engines:
            label = f"{shape} ({engine} kernels)"
            t1 = _pass_ms(results, shape, engine, 1, 1)
            if t1 is not None:
                rows.append((f"{label}: t(1 session × 1 token), ms", _fmt(t1), f"≤ {GOALS[f't1_{tag}_ms']}"))
            t64_5, t64_1 = _pass_ms(results, shape, engine, 64, 5), _pass_ms(results, shape, engine, 64, 1)
            if t64_5 and t64_1:
                goal = f"≤ {GOALS['ratio_64_8b']}" if tag == "8b" else "—"
                rows.append((f"{label}: t(64 × 5) ÷ t(64 × 1)", _fmt(t64_5 / t64_1), goal))
    for key, value in results.get("exactness", {}).items():
        for kind in ("chains", "trees"):
            part = value.get(kind)
            if part:
                rows.append((f"exactness {key}: {kind}, differing / generated tokens",
                             f"{part['differing_tokens']} / {part['tokens']}", "0"))
    cap = results.get("capacity", {}).get("rows", [])
    most = max((r["edges"] for r in cap), default=0)
    for rtt in sorted({r["rtt_ms"] for r in cap}):
        base = next((r for r in cap if r["edges"] == most and r["rtt_ms"] == rtt and r["mode"] == "cloud-only"), None)
        for hyb in (r for r in cap if r["edges"] == most and r["rtt_ms"] == rtt and r["mode"] != "cloud-only"):
            if not (base and base["tokens_per_s"]):
                continue
            alpha = hyb.get("alpha", hyb.get("agree"))
            goal = {(0.8, 0.0): "capacity_a08", (0.6, 0.0): "capacity_a06", (0.8, 20.0): "capacity_a08_rtt20"}.get(
                (alpha, rtt))
            rows.append((f"capacity, {most} edges, RTT {rtt:g} ms, {hyb['mode']} (γ {hyb.get('gamma')}): hybrid ÷ "
                         f"cloud-only tokens/s (95 % range)", _ratio(hyb, base), f"≥ {GOALS[goal]}" if goal else "—"))
            if "differing_tokens" in hyb:
                rows.append((f"capacity, {most} edges, RTT {rtt:g} ms, {hyb['mode']}: differing / compared tokens",
                             f"{hyb['differing_tokens']} / {hyb.get('compared_tokens', '—')}", "0"))
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
    for shape, value in results.get("products", {}).items():
        rows = value["rows"] if isinstance(value, dict) else value  # a dict since the fused products
        if isinstance(value, dict):
            lines += [f"Start-up choices, {shape}: " + "; ".join(f"{k}: {v}" for k, v in value["choices"].items()), ""]
        kernels = [k for k in ("split", "fused", "cublas", "triton") if f"{k}_ms" in rows[0]] if rows else []
        lines += [f"## Matrix products, {shape} (ms, median; invariant: a row's bits at every row count)", "",
                  "| matrix | rows | " + " | ".join(f"{k} ms" for k in kernels) + " | " +
                  " | ".join(f"{k} invariant" for k in kernels) + " |", "|---|---|" + "---|" * (2 * len(kernels))]
        lines += [f"| {r['matrix']} ({r['n']}×{r['k']}) | {r['rows']} | " +
                  " | ".join(f"{r[k + '_ms']:.4f}" for k in kernels) + " | " +
                  " | ".join(str(r.get(f"{k}_rows_invariant")) for k in kernels) + " |" for r in rows]
        lines.append("")
    for name, value in results.get("engines", {}).items():
        lines += ["", f"## Engine start-up, {name}", ""] + [f"- {k}: {v}" for k, v in value.items()]
    cap = results.get("capacity", {}).get("rows", [])
    if cap:
        c = results["capacity"]
        lines += ["", "## Capacity through gRPC, steady state", "",
                  f"{c.get('shape')}; closed-loop edges, {c.get('warm_s')} s warm-up, then a {c.get('window_s')} s window "
                  f"to the deadline; {c.get('draft_ms_per_token')} ms drafting per token; trace: {c.get('trace')}; the "
                  f"verifier {'in a process of its own' if c.get('backend') == 'process' else 'in the front door'}"
                  f"; hold {c.get('hold')}. Front door CPU: the cores the front door's process used over the window "
                  "(with the verifier in it, the verifier's too). Hold: what the replica weighed at the window's end, "
                  "a pass's fixed part / how soon nine in ten edges came back (ms); auto keeps one group while the "
                  "second is the smaller.", "",
                  "| RTT ms | edges | mode | γ | tokens/s (95 %) | per edge: median, its mean's 95 % | fewest per edge | "
                  "p95 step ms (replica) | p95 commit gap ms (edge) | tokens/round | differing / compared | "
                  "front door CPU (cores) | tokens per pass (histogram) | hold: fixed / return ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in cap:
            lines.append(f"| {r['rtt_ms']:g} | {r['edges']} | {r['mode']} | {r.get('gamma') or ''} | "
                         f"{_fmt(r['tokens_per_s'], 0)} {_interval(r.get('tokens_per_s_95'), 0)} | "
                         f"{_fmt(r.get('per_edge_tokens_per_s'), 1)}, {_interval(r.get('per_edge_mean_95'), 1)} | "
                         f"{r.get('min_edge_tokens', '')} | {_fmt(r.get('p95_step_ms'), 1)} | {_fmt(r.get('p95_gap_ms'), 1)} | "
                         f"{_fmt(r.get('tokens_per_round'))} | "
                         f"{r.get('differing_tokens', '')}{' / ' + str(r['compared_tokens']) if 'compared_tokens' in r else ''}"
                         f" | {_fmt(r.get('front_door_cores'))} | {_histogram(r.get('iteration_tokens'))} | "
                         f"{_hold(r.get('hold_inputs_ms'))} |")
    if results.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in results["errors"]]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def _interval(pair, digits: int) -> str:
    return "" if not pair else f"({pair[0]:.{digits}f}–{pair[1]:.{digits}f})"


def _histogram(h: dict | None) -> str:
    """Non-empty buckets as 'upper bound: count' (the last bucket: past every bound)."""
    if not h:
        return ""
    labels = [f"≤{b:g}" for b in h["bounds"]] + [f">{h['bounds'][-1]:g}"]
    return ", ".join(f"{label}: {n}" for label, n in zip(labels, h["counts"]) if n)


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
    # "eager": the first engine, in the results of runs before its removal; "split": the first Triton products.
    styles = {"torch": "-", "fused": "-", "eager": "--", "split": "--"}
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
        most = max(r["edges"] for r in cap)
        bars = [r for r in cap if r["edges"] == most]  # the steady-state runs at the most edges, with intervals
        lows = [r["tokens_per_s"] - (r.get("tokens_per_s_95") or (r["tokens_per_s"],) * 2)[0] for r in bars]
        highs = [(r.get("tokens_per_s_95") or (r["tokens_per_s"],) * 2)[1] - r["tokens_per_s"] for r in bars]
        ax.barh(range(len(bars)), [r["tokens_per_s"] for r in bars], xerr=[lows, highs], capsize=3,
                color=["grey" if r["mode"] == "cloud-only" else "tab:blue" for r in bars])
        ax.set_yticks(range(len(bars)), [f"{r['mode']}, RTT {r['rtt_ms']:g}" for r in bars], fontsize=6)
        ax.set(title=f"capacity, {most} edges ({results['capacity'].get('shape')})",
               xlabel="committed tokens/s in the window (95 %)")
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=120)
