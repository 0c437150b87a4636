"""Plots and a Markdown summary of an experiment's results (`hybridspec experiment report`).

Every varied condition but RTT gets its own panel (lab/aggregate.py), every point its 95 % interval
over prompts, every strategy one style (colour, marker and line from the Okabe–Ito palette, which
stays distinct under the common colour-vision deficiencies). Baselines without a network are
horizontal bands (mean and interval) in each panel; the drafter alone (edge-only) gets its own panel.

The analytic bound overlaid on the speed-up plot is docs/design.md §2's
    S(γ, r) = (1 − α^(γ+1)) / ((1 − α)(γ·c + r + v)),  best over γ ≤ 8,
with r = RTT/T, c = t_d/T, v = t_v/T and T, t_d, t_v as the edges measured them, and α the
per-token acceptance that reproduces the measured tokens per round of the fixed-γ strategy.
"""
from __future__ import annotations

import math
import statistics
import textwrap
from pathlib import Path

from ..edge import policy
from . import aggregate as agg
from .rows import read_rows
from .stats import Estimate

MAX_GAMMA = 8
# Okabe & Ito, "Color Universal Design" (2008): eight colours told apart with any common colour-vision deficiency.
OKABE_ITO = ("#000000", "#E69F00", "#56B4E9", "#009E73", "#0072B2", "#D55E00", "#CC79A7", "#F0E442")  # yellow, faint on white, last
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINES = ("-", "--", "-.", ":")


def style(index: int) -> dict:
    """The plot style of the index-th strategy: unique for the first 32 (colour and line differ)."""
    return {"color": OKABE_ITO[index % 8], "marker": MARKERS[(index + index // 8) % 8],
            "linestyle": LINES[(index // 8) % 4]}


def report(results: Path, out: Path) -> list[Path]:
    """Write the plots and summary.md into `out`; returns the files written."""
    rows = agg.ok_rows(read_rows(results))
    if not rows:
        raise FileNotFoundError(f"{results} holds no successful rows to report on")
    out.mkdir(parents=True, exist_ok=True)
    order = {s: i for i, s in enumerate(dict.fromkeys(r["strategy"] for r in rows))}  # run order, stable
    panels = agg.facets(rows)
    files = [_plot_throughput(panels, order, out / "tokens_per_s_vs_rtt.png"),
             _plot_speedup(panels, order, out / "speedup_vs_rtt.png"),
             _plot_positions(panels, order, out / "acceptance_per_position.png"),
             _plot_costs(rows, order, out / "cloud_calls_and_bytes_per_token.png")]
    if len({r.get("edges", 1) for r in rows if r.get("rtt_ms") is not None}) > 1:
        files.append(_plot_capacity(rows, order, out / "capacity_vs_edges.png"))
    summary = out / "summary.md"
    summary.write_text(_markdown(rows, panels))
    return files + [summary]


# ---- the analytic bound -------------------------------------------------------------------------

def _alpha_for(tokens_per_round: float, gamma: int) -> float:
    """The i.i.d. α whose E(γ) equals the measured tokens per round."""
    lo, hi = 0.0, 0.999
    for _ in range(60):
        mid = (lo + hi) / 2
        if policy.expected_tokens([mid] * gamma, gamma) < tokens_per_round:
            lo = mid
        else:
            hi = mid
    return lo


def bound_inputs(rows: list[dict]) -> dict | None:
    """α, c, v and T for the analytic bound, from the fixed-γ hybrid strategy with the largest γ."""
    fixed = [r for r in rows if r["kind"] == "hybrid" and r.get("rates") and r.get("mean_gamma")
             and r.get("rounds") and r.get("switches_to_cloud", 0) == 0]
    if not fixed:
        return None
    gamma = max(round(r["mean_gamma"]) for r in fixed)
    chosen = [r for r in fixed if round(r["mean_gamma"]) == gamma]
    t = statistics.mean(r["rates"]["cloud_token_s"] for r in chosen)
    alpha = _alpha_for(statistics.mean(r["mean_tokens_per_round"] for r in chosen), gamma)
    c = statistics.mean(r["rates"]["draft_s"] for r in chosen) / t
    v = statistics.mean(r["rates"]["verify_block_s"] + r["rates"]["verify_per_draft_s"] * gamma for r in chosen) / t
    base_rtt = min(r["rates"]["rtt_s"] for r in chosen if r["rtt_ms"] == min(x["rtt_ms"] for x in chosen))
    return {"alpha": alpha, "c": c, "v": v, "T": t, "gamma": gamma, "base_rtt_s": base_rtt}


def bound(fit: dict, rtt_ms: float) -> float:
    """The best-γ speed-up over cloud-only at this emulated RTT (plus the measured base RTT)."""
    t = fit["T"]
    rates = policy.Rates(alphas=[fit["alpha"]] * (MAX_GAMMA + 1), draft_s=fit["c"] * t,
                         rtt_s=rtt_ms / 1e3 + fit["base_rtt_s"], verify_single_s=fit["v"] * t,
                         verify_block_s=fit["v"] * t, verify_per_draft_s=0.0, cloud_token_s=t)
    return policy.best_speedup(rates, MAX_GAMMA, pipelined=False)


def predicted_crossover_ms(fit: dict) -> float | None:
    """The RTT (ms) where the bound falls to 1, by bisection; None if it never is above 1."""
    if bound(fit, 0.0) <= 1:
        return None
    lo, hi = 0.0, 10_000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if bound(fit, mid) > 1 else (lo, mid)
    return lo


# ---- plots --------------------------------------------------------------------------------------

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(n: int, width: float = 5.5, height: float = 4.0):
    """A figure with n panels in rows of at most three."""
    plt = _plt()
    cols = min(n, 3)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(width * cols, height * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _save(fig, path: Path, legend_axes=None) -> Path:
    handles = {}
    for ax in legend_axes or fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    width, height = fig.get_size_inches()
    lines = 1
    if fig._suptitle is not None:  # wrapped to the figure's width, and room kept for it above the panels
        wrapped = textwrap.fill(fig._suptitle.get_text(), int(width * 10))  # about 10 title characters an inch
        fig._suptitle.set_text(wrapped)
        lines = wrapped.count("\n") + 1
    top = 1 - 0.05 * lines / height
    if handles:
        fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(4, len(handles)), fontsize=8,
                   frameon=False)
        fig.tight_layout(rect=(0, (0.3 + 0.2 * math.ceil(len(handles) / 4)) / height, 1, top))
    else:
        fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path


def _errorbar(ax, xs: list, estimates: list[Estimate], label: str, st: dict) -> None:
    ys = [e.value for e in estimates]
    yerr = [[max(0.0, e.value - e.lo) for e in estimates], [max(0.0, e.hi - e.value) for e in estimates]]
    ax.errorbar(xs, ys, yerr=yerr, label=label, capsize=3, lw=1.4, ms=5, **st)


def _band(ax, e: Estimate, label: str, st: dict) -> None:
    """A baseline without a network: its mean as a line across the panel, its interval shaded."""
    ax.axhline(e.value, color=st["color"], lw=1.2, ls=st["linestyle"], label=f"{label} (no network)")
    ax.axhspan(e.lo, e.hi, color=st["color"], alpha=0.15, lw=0)


def _plot_throughput(panels: list[agg.Facet], order: dict, path: Path) -> Path:
    edge_only = [p for p in panels if any(r["kind"] == "edge_only" for r in p.rows)]
    fig, axes = _grid(len(panels) + (1 if edge_only else 0))
    for ax, panel in zip(axes, panels):
        kinds = agg.kinds(panel.rows)
        for strategy, curve in sorted(agg.curves(panel).items(), key=lambda kv: order[kv[0]]):
            st = style(order[strategy])
            if kinds[strategy] == "edge_only":
                continue
            if None in curve:
                _band(ax, curve[None], strategy, st)
            else:
                rtts = sorted(curve)
                _errorbar(ax, rtts, [curve[r] for r in rtts], strategy, st)
        _panel_axes(ax, panel, "tokens / s")
        ax.set_ylim(bottom=0)
    if edge_only:  # the drafter alone is several times faster: its own panel keeps the others readable
        ax = axes[-1]
        labels, values, seen = [], [], set()
        for panel in edge_only:
            local = frozenset(id(r) for r in panel.rows if r["kind"] == "edge_only")
            if local in seen:  # panels differing only in network conditions share one edge-only run
                continue
            seen.add(local)
            shared = dict(panel.values)
            name = " · ".join(f"{agg.LABELS[k]} {agg.show(k, shared[k])}" for k in agg.LOCAL_KEYS
                              if k in shared and k != "edges") or "all"
            for strategy, curve in agg.curves(panel).items():
                if agg.kinds(panel.rows)[strategy] == "edge_only" and None in curve:
                    labels.append(textwrap.shorten(name, 60))
                    values.append(curve[None])
        st = style(order[next(r["strategy"] for r in edge_only[0].rows if r["kind"] == "edge_only")])
        ax.barh(range(len(values)), [e.value for e in values], xerr=[[max(0.0, e.value - e.lo) for e in values],
                                                                      [max(0.0, e.hi - e.value) for e in values]],
                color=st["color"], alpha=0.7, capsize=3)
        ax.set_yticks(range(len(values)), labels, fontsize=7)
        ax.set(xlabel="tokens / s", title="edge-only: the drafter alone, no network (lower quality)")
    fig.suptitle("throughput vs round-trip time (mean and 95 % CI over prompts); " + _baseline_note(panels))
    return _save(fig, path, axes[:len(panels)])


def _panel_axes(ax, panel: agg.Facet, ylabel: str) -> None:
    """Labels, the panel's own title, and RTT ticks where the points are."""
    rtts = sorted({r["rtt_ms"] for r in panel.rows if r.get("rtt_ms") is not None})
    ax.set(xlabel="emulated RTT (ms)", ylabel=ylabel, title=textwrap.fill(panel.label, 45))
    if rtts:
        ax.set_xticks(rtts)
        if len(rtts) == 1:
            ax.set_xlim(rtts[0] - 10, rtts[0] + 10)
    ax.grid(alpha=0.3)


def _baseline_note(panels: list[agg.Facet]) -> str:
    """What "baseline" means in the panel titles."""
    usual = panels[0].usual if panels else ()
    return "baseline: " + (" · ".join(f"{agg.LABELS[k]} {agg.show(k, v)}" for k, v in usual) or "all rows")


def _plot_speedup(panels: list[agg.Facet], order: dict, path: Path) -> Path:
    fig, axes = _grid(len(panels))
    for ax, panel in zip(axes, panels):
        curves = agg.speedups(panel)
        for strategy, curve in sorted(curves.items(), key=lambda kv: order[kv[0]]):
            rtts = sorted(curve)
            if rtts:
                _errorbar(ax, rtts, [curve[r] for r in rtts], strategy, style(order[strategy]))
        fit = bound_inputs([r for r in panel.rows if r.get("rtt_ms") is not None])
        rtts = sorted({r for c in curves.values() for r in c})
        if fit is not None and len(rtts) > 1:
            xs = [rtts[0] + (rtts[-1] - rtts[0]) * i / 100 for i in range(101)]
            ax.plot(xs, [bound(fit, x) for x in xs], color="grey", lw=2, alpha=0.6,
                    label=f"analytic bound (best γ ≤ {MAX_GAMMA}, measured α, c, v)")
        ax.axhline(1.0, color="black", lw=0.8)
        _panel_axes(ax, panel, "speed-up over cloud-only")
    fig.suptitle("hybrid speed-up vs round-trip time (95 % bootstrap CI over prompts); " + _baseline_note(panels))
    return _save(fig, path)


def _wilson(accepted: int, drafted: int, z: float = 1.96) -> tuple[float, float, float]:
    """A proportion and its Wilson score interval."""
    p = accepted / drafted
    centre = (p + z * z / (2 * drafted)) / (1 + z * z / drafted)
    half = z * math.sqrt(p * (1 - p) / drafted + z * z / (4 * drafted * drafted)) / (1 + z * z / drafted)
    return p, centre - half, centre + half


def _plot_positions(panels: list[agg.Facet], order: dict, path: Path) -> Path:
    fig, axes = _grid(len(panels), 5.0, 3.6)
    for ax, panel in zip(axes, panels):
        sums: dict[str, list[list[int]]] = {}
        for r in panel.rows:
            if r["kind"] != "hybrid" or not r.get("drafted_at"):
                continue
            d, a = sums.setdefault(r["strategy"], [[], []])
            for j, (dj, aj) in enumerate(zip(r["drafted_at"], r["accepted_at"])):
                if j == len(d):
                    d.append(0)
                    a.append(0)
                d[j] += dj
                a[j] += aj
        for strategy, (d, a) in sorted(sums.items(), key=lambda kv: order[kv[0]]):
            positions = [j for j in range(len(d)) if d[j]]
            cis = [_wilson(a[j], d[j]) for j in positions]
            _errorbar(ax, positions, [Estimate(p, lo, hi, d[j]) for (p, lo, hi), j in zip(cis, positions)], strategy,
                      style(order[strategy]))
        ax.set(xlabel="draft position (from 0)", ylabel="P(accepted | drafted)", ylim=(0, 1),
               title=textwrap.fill(panel.label, 45))
        ax.grid(alpha=0.3)
    fig.suptitle("acceptance per draft position, all RTTs (95 % Wilson CI)")
    return _save(fig, path)


def _plot_costs(rows: list[dict], order: dict, path: Path) -> Path:
    plt = _plt()
    linked = [r for r in rows if r["kind"] in ("hybrid", "cloud_only")]
    names = sorted({r["strategy"] for r in linked}, key=order.get)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.5 * len(names) + 2))
    for ax, field, label in ((left, "cloud_calls_per_token", "cloud calls per token (verify rounds + streams)"),
                             (right, "bytes_per_token", "bytes per token (protobuf payload, both ways)")):
        values = [agg.estimate([r for r in linked if r["strategy"] == n], field) for n in names]
        ax.barh(names, [v.value if v else 0 for v in values],
                xerr=[[v.value - v.lo if v else 0 for v in values], [v.hi - v.value if v else 0 for v in values]],
                color=[style(order[n])["color"] for n in names], capsize=3)
        ax.set(xlabel=label)
    fig.suptitle("what each token costs on the link (all conditions; 95 % CI over prompts)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_capacity(rows: list[dict], order: dict, path: Path) -> Path:
    plt = _plt()
    cap = agg.capacity(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for strategy, by_edges in sorted(cap.items(), key=lambda kv: order[kv[0]]):
        edges = sorted(by_edges)
        st = style(order[strategy])
        _errorbar(left, edges, [by_edges[e][0] for e in edges], strategy, st)
        _errorbar(right, edges, [by_edges[e][1] for e in edges], strategy, st)
    left.set(xlabel="concurrent edges", ylabel="tokens / s per edge", title="what each edge gets")
    right.set(xlabel="concurrent edges", ylabel="tokens / s served by the cloud",
              title="cloud capacity (tokens of all edges / wall time)")
    for ax in (left, right):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle("one verifier replica, many edges (mean and 95 % CI over concurrent groups)")
    return _save(fig, path, [left])


# ---- summary ------------------------------------------------------------------------------------

def _cell(e: Estimate | None, digits: int = 1) -> str:
    if e is None:
        return ""
    return f"{e.value:.{digits}f}" if e.n < 2 else f"{e.value:.{digits}f} ± {e.half_width:.{digits}f}"


def _markdown(rows: list[dict], panels: list[agg.Facet]) -> str:
    kinds = agg.kinds(rows)
    prompts = len({r["prompt"] for r in rows})
    repeats = len({r.get("repeat") for r in rows})
    lines = [f"# Experiment `{rows[0]['experiment']}`", "",
             f"{len(rows)} generations: {prompts} prompts × {repeats} repeats per point. Cells are means over "
             "prompts (each prompt averaged over its repeats and edges) ± the half-width of the 95 % t interval "
             "over prompts; speed-ups and crossovers carry 95 % bootstrap intervals over prompts. Each panel "
             "below is one combination of the conditions that were varied besides RTT; nothing is pooled across "
             "them.", ""]
    same, judged = agg.exactness(rows)
    if judged:
        lines += [f"Greedy exactness against the target's own decoding (the served engine alone, one token per "
                  f"pass, computed once per prompt, not a row of this sweep): **{same}/{judged}** cloud-only, hybrid "
                  "and co-located generations identical.", ""]
    for panel in panels:
        lines += _panel_markdown(panel, kinds)
    return "\n".join(lines) + "\n"


def _panel_markdown(panel: agg.Facet, kinds: dict[str, str]) -> list[str]:
    table = agg.curves(panel)
    rtts = sorted({r for c in table.values() for r in c if r is not None})
    lines = [f"## {panel.title}", "", "Tokens/s:", "",
             "| strategy | kind | " + " | ".join(f"RTT {r:g} ms" for r in rtts) + " | no network |",
             "|---|---|" + "---|" * (len(rtts) + 1)]
    for strategy in sorted(table, key=lambda s: (kinds[s], s)):
        curve = table[strategy]
        lines.append(f"| {strategy} | {kinds[strategy]} | " + " | ".join(_cell(curve.get(r)) for r in rtts)
                     + f" | {_cell(curve.get(None))} |")
    speedups = agg.speedups(panel)
    if speedups:
        lines += ["", "Speed-up over cloud-only at the same RTT, and the RTT where it falls to 1:", "",
                  "| strategy | " + " | ".join(f"{r:g} ms" for r in rtts) + " | crossover |",
                  "|---|" + "---|" * (len(rtts) + 1)]
        for strategy, curve in sorted(speedups.items()):
            cross = agg.crossover(panel, strategy)
            cells = [f"{curve[r].value:.2f} [{curve[r].lo:.2f}, {curve[r].hi:.2f}]" if r in curve else "" for r in rtts]
            lines.append(f"| {strategy} | " + " | ".join(cells) + f" | {cross.text() if cross else ''} |")
        lines += ["", "The worst prompt's own speed-up (mean over its repeats, with a 95 % bootstrap interval over "
                  "them), and which prompt:", "",
                  "| strategy | " + " | ".join(f"{r:g} ms" for r in rtts) + " |", "|---|" + "---|" * len(rtts)]
        for strategy in sorted(speedups):
            worst = agg.worst_prompts(panel, strategy)
            lines.append(f"| {strategy} | " + " | ".join(f"{worst[r][1].value:.2f} [{worst[r][1].lo:.2f}, {worst[r][1].hi:.2f}] (prompt {worst[r][0]})" if r in worst
                                                        else "" for r in rtts) + " |")
    fit = bound_inputs([r for r in panel.rows if r.get("rtt_ms") is not None])
    if fit is not None:
        pred = predicted_crossover_ms(fit)
        lines += ["", f"Analytic bound inputs (measured): α = {fit['alpha']:.3f} (from γ = {fit['gamma']} rounds), "
                  f"c = {fit['c']:.3f}, v = {fit['v']:.2f}, T = {fit['T'] * 1e3:.1f} ms, base RTT = "
                  f"{fit['base_rtt_s'] * 1e3:.1f} ms; predicted crossover: "
                  + ("none (the bound never exceeds 1)" if pred is None else f"{pred:.0f} ms") + "."]
    measured = [(s, rtt) for s, curve in table.items() for rtt in curve if rtt is not None]
    if measured:
        lines += ["", "Measured by the edge (means over prompts): the RTT it saw, time to first token, and the "
                  "time between commits (a round, or a streamed token), median and 95th percentile:", "",
                  "| strategy | RTT set (ms) | RTT measured (ms) | TTFT (s) | step p50 (ms) | step p95 (ms) |",
                  "|---|---|---|---|---|---|"]
        for strategy, rtt in sorted(measured, key=lambda sr: (sr[0], sr[1])):
            at = [r for r in panel.rows if r["strategy"] == strategy and r.get("rtt_ms") == rtt]
            cells = [_cell(agg.estimate(at, f), d) for f, d in (("measured_rtt_ms", 1), ("ttft_s", 2),
                                                                ("step_ms_p50", 1), ("step_ms_p95", 1))]
            lines.append(f"| {strategy} | {rtt:g} | " + " | ".join(cells) + " |")
    return lines + [""]
