"""Plots and a Markdown summary of an experiment's results (`hybridspec experiment report`).

The analytic bound overlaid on the speed-up plot is docs/design.md §2's
    S(γ, r) = (1 − α^(γ+1)) / ((1 − α)(γ·c + r + v)),  best over γ ≤ 8,
with r = RTT/T, c = t_d/T, v = t_v/T and T, t_d, t_v as the edges measured them, and α the
per-token acceptance that reproduces the measured tokens per round of the fixed-γ strategy.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from .runner import read_rows

MAX_GAMMA = 8


def report(results: Path, out: Path) -> list[Path]:
    """Write the plots and summary.md into `out`; returns the files written."""
    rows = [r for r in read_rows(results) if "error" not in r and r.get("wall_s")]
    if not rows:
        raise FileNotFoundError(f"{results} holds no successful rows to report on")
    out.mkdir(parents=True, exist_ok=True)
    temperature = min(r["temperature"] for r in rows)
    one_edge = [r for r in rows if r["temperature"] == temperature and r.get("edges", 1) == 1]
    # Each bandwidth gets its own tables; the plots show the unlimited link (0), else the widest.
    bandwidths = sorted({r.get("bandwidth_mbps") or 0 for r in one_edge}, key=lambda b: (b != 0, -b))
    by_bandwidth = {b: [r for r in one_edge if (r.get("bandwidth_mbps") or 0) == b] for b in bandwidths}
    base = by_bandwidth[bandwidths[0]]
    table = _mean_by(base, "tokens_per_s")
    fit = _bound_inputs(base)
    files = [_plot_throughput(table, out / "tokens_per_s_vs_rtt.png"),
             _plot_speedup(table, _kinds(base), fit, out / "speedup_vs_rtt.png"),
             _plot_positions(base, out / "acceptance_per_position.png"),
             _plot_costs(base, out / "cloud_calls_and_bytes_per_token.png")]
    summary = out / "summary.md"
    sections = [_markdown(rows, _mean_by(group, "tokens_per_s"), _bound_inputs(group), temperature, b)
                for b, group in by_bandwidth.items()]
    summary.write_text("\n".join(sections))
    return files + [summary]


# ---- aggregation ------------------------------------------------------------------------------

def _mean_by(rows: list[dict], field: str) -> dict[str, dict]:
    """strategy -> {rtt (None for local baselines) -> mean of field}."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        if r.get(field) is not None:
            groups[(r["strategy"], r["rtt_ms"])].append(r[field])
    table: dict[str, dict] = defaultdict(dict)
    for (strategy, rtt), values in groups.items():
        table[strategy][rtt] = statistics.mean(values)
    return dict(table)


def _kinds(rows: list[dict]) -> dict[str, str]:
    return {r["strategy"]: r["kind"] for r in rows}


def _alpha_for(tokens_per_round: float, gamma: int) -> float:
    """The i.i.d. α whose E(γ) = (1 − α^(γ+1))/(1 − α) equals the measured tokens per round."""
    lo, hi = 0.0, 0.999
    for _ in range(60):
        mid = (lo + hi) / 2
        if (1 - mid ** (gamma + 1)) / (1 - mid) < tokens_per_round:
            lo = mid
        else:
            hi = mid
    return lo


def _bound_inputs(rows: list[dict]) -> dict | None:
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
    """The brief's best-γ speed-up over cloud-only at this emulated RTT (plus the measured base RTT)."""
    r = (rtt_ms / 1e3 + fit["base_rtt_s"]) / fit["T"]
    a = fit["alpha"]
    return max((1 - a ** (g + 1)) / ((1 - a) * (g * fit["c"] + r + fit["v"])) for g in range(1, MAX_GAMMA + 1))


def predicted_crossover_ms(fit: dict) -> float | None:
    """The RTT (ms) where the bound falls to 1, by bisection; None if it never is above 1."""
    if bound(fit, 0.0) <= 1:
        return None
    lo, hi = 0.0, 10_000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if bound(fit, mid) > 1 else (lo, mid)
    return lo


def observed_crossover_ms(speedups: dict[float, float]) -> float | None:
    """First RTT where a speed-up curve drops to 1, linearly interpolated; None if it never does."""
    points = sorted(speedups.items())
    if not points or points[0][1] <= 1:
        return 0.0 if points else None
    for (r0, s0), (r1, s1) in zip(points, points[1:]):
        if s1 <= 1 < s0:
            return r0 + (s0 - 1) / (s0 - s1) * (r1 - r0)
    return None


def _speedups(table: dict[str, dict], kinds: dict[str, str]) -> dict[str, dict[float, float]]:
    cloud = next((table[s] for s, k in kinds.items() if k == "cloud_only" and s in table), None)
    if cloud is None:
        return {}
    return {s: {rtt: v / cloud[rtt] for rtt, v in curve.items() if rtt in cloud and cloud[rtt]}
            for s, curve in table.items() if kinds[s] == "hybrid"}


# ---- plots --------------------------------------------------------------------------------------

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path


def _plot_throughput(table: dict[str, dict], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    for strategy, curve in sorted(table.items()):
        if None in curve:
            ax.axhline(curve[None], ls="--", lw=1, label=f"{strategy} (no network)")
        else:
            rtts = sorted(curve)
            ax.plot(rtts, [curve[r] for r in rtts], marker="o", label=strategy)
    ax.set(xlabel="emulated RTT (ms)", ylabel="tokens / s", title="throughput vs round-trip time")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def _plot_speedup(table: dict[str, dict], kinds: dict[str, str], fit: dict | None, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    kinds_curves = _speedups(table, kinds)
    for strategy, curve in sorted(kinds_curves.items()):
        rtts = sorted(curve)
        ax.plot(rtts, [curve[r] for r in rtts], marker="o", label=strategy)
    if fit is not None and kinds_curves:
        rtts = sorted({r for c in kinds_curves.values() for r in c})
        xs = [rtts[0] + (rtts[-1] - rtts[0]) * i / 100 for i in range(101)]
        ax.plot(xs, [bound(fit, x) for x in xs], "k--", lw=1.5,
                label=f"analytic bound (α={fit['alpha']:.2f}, c={fit['c']:.2f}, v={fit['v']:.2f}, best γ≤{MAX_GAMMA})")
    ax.axhline(1.0, color="grey", lw=1)
    ax.set(xlabel="emulated RTT (ms)", ylabel="speed-up over cloud-only", title="hybrid speed-up vs round-trip time")
    ax.legend(fontsize=7)
    return _save(fig, path)


def _plot_positions(rows: list[dict], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    sums: dict[str, list[list[int]]] = {}
    for r in rows:
        if r["kind"] != "hybrid" or not r.get("drafted_at"):
            continue
        d, a = sums.setdefault(r["strategy"], [[], []])
        for j, (dj, aj) in enumerate(zip(r["drafted_at"], r["accepted_at"])):
            if j == len(d):
                d.append(0)
                a.append(0)
            d[j] += dj
            a[j] += aj
    for strategy, (d, a) in sorted(sums.items()):
        positions = [j + 1 for j in range(len(d)) if d[j]]
        ax.plot(positions, [a[j - 1] / d[j - 1] for j in positions], marker="o", label=strategy)
    ax.set(xlabel="draft position j", ylabel="P(accepted | drafted)", ylim=(0, 1),
           title="acceptance per draft position (all RTTs)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def _plot_costs(rows: list[dict], path: Path) -> Path:
    plt = _plt()
    linked = [r for r in rows if r["kind"] in ("hybrid", "cloud_only")]
    calls = _mean_by(linked, "cloud_calls_per_token")
    bytes_ = _mean_by(linked, "bytes_per_token")
    names = sorted(calls)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.barh(names, [statistics.mean(calls[n].values()) for n in names])
    left.set(xlabel="cloud calls per token (verify rounds + streams)")
    right.barh(names, [statistics.mean(bytes_[n].values()) for n in names])
    right.set(xlabel="bytes per token (protobuf payload, both ways)")
    return _save(fig, path)


# ---- summary ------------------------------------------------------------------------------------

def _markdown(rows: list[dict], table: dict[str, dict], fit: dict | None, temperature: float,
              bandwidth_mbps: float = 0) -> str:
    kinds = _kinds(rows)
    rtts = sorted({r for c in table.values() for r in c if r is not None})
    link = "unlimited bandwidth" if not bandwidth_mbps else f"{bandwidth_mbps:g} Mbit/s each way"
    lines = [f"# Experiment `{rows[0]['experiment']}`: {link}", "",
             f"{len(rows)} generations in all; mean tokens/s over prompts and repeats at temperature {temperature}, "
             "one edge. Strategies without a network (no RTT) ran once.", "",
             "| strategy | kind | " + " | ".join(f"RTT {r:g} ms" for r in rtts) + " | no network |",
             "|---|---|" + "---|" * (len(rtts) + 1)]
    for strategy in sorted(table, key=lambda s: (kinds[s], s)):
        curve = table[strategy]
        cells = [f"{curve[r]:.1f}" if r in curve else "" for r in rtts]
        local = f"{curve[None]:.1f}" if None in curve else ""
        lines.append(f"| {strategy} | {kinds[strategy]} | " + " | ".join(cells) + f" | {local} |")
    speedups = _speedups(table, kinds)
    if speedups:
        lines += ["", "Speed-up over cloud-only at the same RTT:", "",
                  "| strategy | " + " | ".join(f"{r:g} ms" for r in rtts) + " | crossover (observed) |",
                  "|---|" + "---|" * (len(rtts) + 1)]
        for strategy, curve in sorted(speedups.items()):
            cross = observed_crossover_ms(curve)
            cross_text = "below 1 from the lowest RTT" if cross == 0.0 else ("above 1 throughout" if cross is None else f"{cross:.0f} ms")
            lines.append(f"| {strategy} | " + " | ".join(f"{curve[r]:.2f}" if r in curve else "" for r in rtts) +
                         f" | {cross_text} |")
    if fit is not None:
        pred = predicted_crossover_ms(fit)
        lines += ["", f"Analytic bound inputs (measured): α = {fit['alpha']:.3f} (from γ = {fit['gamma']} rounds), "
                  f"c = {fit['c']:.3f}, v = {fit['v']:.2f}, T = {fit['T'] * 1e3:.1f} ms, "
                  f"base RTT = {fit['base_rtt_s'] * 1e3:.1f} ms. Predicted crossover RTT: "
                  + ("none (the bound never exceeds 1)" if pred is None else f"{pred:.0f} ms") + "."]
    exact = [r for r in rows if r.get("same_as_target") is not None and r["kind"] in ("hybrid", "colocated")]
    if exact:
        same = sum(r["same_as_target"] for r in exact)
        lines += ["", f"Greedy exactness: {same}/{len(exact)} hybrid and co-located generations produced exactly "
                  "the cloud-only (target-alone) tokens."]
    return "\n".join(lines) + "\n"
