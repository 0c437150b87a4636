"""From an experiment's rows to the numbers its report shows: facets, per-point means with intervals,
speed-ups, crossovers, paired differences, capacity. Pure functions over row dicts (no plotting).

A facet is one combination of every condition other than RTT that takes more than one value in the
rows (link, bandwidth, jitter, loss, edges, temperature, drafter, prompt set): rows are never pooled
across a condition that was varied. The unit of replication is the prompt: a point's value is the
mean over prompts of each prompt's mean over repeats (and concurrent edges), and intervals are over
prompts (lab/stats.py).
"""
from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass

from .stats import Estimate, bootstrap_ci, crossing, mean_ci

FACET_KEYS = ("link", "bandwidth_mbps", "jitter_ms", "loss_pct", "edges", "temperature", "drafter", "prompt_set")
LOCAL_KEYS = ("edges", "temperature", "drafter", "prompt_set")  # what a baseline without a network shares
LABELS = {"link": "link", "bandwidth_mbps": "Mbit/s", "jitter_ms": "jitter ms", "loss_pct": "loss %", "edges": "edges",
          "temperature": "T", "drafter": "drafter", "prompt_set": "prompts"}


@dataclass(frozen=True)
class Facet:
    """One panel: the values of the varied conditions, and its rows (baselines without a network
    included where they share temperature, drafter and prompt set)."""

    values: tuple[tuple[str, object], ...]
    rows: tuple[dict, ...]
    usual: tuple[tuple[str, object], ...] = ()  # each varied condition's most common value over the panels

    @property
    def title(self) -> str:
        """Every varied condition's value, e.g. "Mbit/s 1 · T 0" ("all rows" when nothing was varied)."""
        return " · ".join(f"{LABELS[k]} {show(k, v)}" for k, v in self.values) or "all rows"

    @property
    def label(self) -> str:
        """Only what sets this panel apart from the usual conditions ("baseline" when nothing does)."""
        usual = dict(self.usual)
        return " · ".join(f"{LABELS[k]} {show(k, v)}" for k, v in self.values if usual.get(k) != v) or "baseline"


def show(key: str, value) -> str:
    """A condition's value as people read it."""
    if key == "bandwidth_mbps" and not value:
        return "unlimited"
    if value == "" or value is None:
        return {"link": "none", "drafter": "default"}.get(key, "-")
    return f"{value:g}" if isinstance(value, float) else str(value)


def ok_rows(rows: list[dict]) -> list[dict]:
    """Rows that finished and took time."""
    return [r for r in rows if "error" not in r and r.get("wall_s")]


def facets(rows: list[dict]) -> list[Facet]:
    """The rows split by every varied condition but RTT, in a stable order."""
    linked = [r for r in rows if r.get("rtt_ms") is not None]
    local = [r for r in rows if r.get("rtt_ms") is None]
    varied = [k for k in FACET_KEYS if len({r.get(k) for r in linked or rows}) > 1]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in linked:
        groups[tuple((k, r.get(k)) for k in varied)].append(r)
    if not groups:  # only baselines without a network
        groups[()] = []
    counts = {k: Counter(dict(values)[k] for values in groups) for k in varied}
    usual = tuple((k, counts[k].most_common(1)[0][0]) for k in varied)
    out = []
    for values, members in sorted(groups.items(), key=lambda kv: [_order(v) for _, v in kv[0]]):
        shared = {k: v for k, v in values if k in LOCAL_KEYS and k != "edges"}
        baselines = [r for r in local if all(r.get(k) == v for k, v in shared.items())]
        out.append(Facet(values, tuple(members + baselines), usual))
    return sorted(out, key=lambda f: f.label != "baseline")


def _order(value) -> tuple:
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


def per_prompt(rows: list[dict], field: str) -> dict[int, float]:
    """prompt -> the mean of `field` over its rows (repeats, concurrent edges)."""
    groups: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        if r.get(field) is not None:
            groups[r["prompt"]].append(r[field])
    return {p: statistics.fmean(v) for p, v in groups.items()}


def estimate(rows: list[dict], field: str) -> Estimate | None:
    """Mean of `field` with a 95 % interval over prompts (over rows when there is one prompt)."""
    by_prompt = per_prompt(rows, field)
    if len(by_prompt) >= 2:
        return mean_ci(list(by_prompt.values()))
    values = [r[field] for r in rows if r.get(field) is not None]
    return mean_ci(values) if values else None


def curves(facet: Facet, field: str = "tokens_per_s") -> dict[str, dict]:
    """strategy -> {rtt_ms (None: no network) -> Estimate of field}."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in facet.rows:
        groups[(r["strategy"], r.get("rtt_ms"))].append(r)
    out: dict[str, dict] = defaultdict(dict)
    for (strategy, rtt), members in groups.items():
        value = estimate(members, field)
        if value is not None:
            out[strategy][rtt] = value
    return dict(out)


def kinds(rows) -> dict[str, str]:
    """strategy -> kind."""
    return {r["strategy"]: r["kind"] for r in rows}


def cloud_strategy(rows) -> str | None:
    """The cloud-only strategy every speed-up divides by."""
    return next((s for s, k in kinds(rows).items() if k == "cloud_only"), None)


def _ratio_by_rtt(rows: list[dict], strategy: str, base: str, prompts: list[int]) -> dict[float, float]:
    """rtt -> mean tokens/s of `strategy` / mean of `base`, over the given prompts (with repeats)."""
    out = {}
    by = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("rtt_ms") is not None and r["strategy"] in (strategy, base) and r.get("tokens_per_s") is not None:
            by[r["rtt_ms"]][r["strategy"], r["prompt"]].append(r["tokens_per_s"])
    for rtt, cells in by.items():
        num = [statistics.fmean(cells[strategy, p]) for p in prompts if (strategy, p) in cells]
        den = [statistics.fmean(cells[base, p]) for p in prompts if (base, p) in cells]
        if num and den and statistics.fmean(den) > 0:
            out[rtt] = statistics.fmean(num) / statistics.fmean(den)
    return out


def speedups(facet: Facet) -> dict[str, dict[float, Estimate]]:
    """hybrid strategy -> {rtt -> speed-up over cloud-only at that RTT, with a bootstrap interval
    over prompts (both strategies' values of a resampled prompt travel together)}."""
    base = cloud_strategy(facet.rows)
    if base is None:
        return {}
    prompts = sorted({r["prompt"] for r in facet.rows})
    out: dict[str, dict[float, Estimate]] = {}
    for strategy, kind in kinds(facet.rows).items():
        if kind != "hybrid":
            continue
        rtts = sorted(_ratio_by_rtt(facet.rows, strategy, base, prompts))
        out[strategy] = {}
        for rtt in rtts:
            at = [r for r in facet.rows if r.get("rtt_ms") == rtt]
            value = bootstrap_ci(prompts, lambda ps, at=at, rtt=rtt, s=strategy: _ratio_by_rtt(at, s, base, ps).get(rtt))
            if value is not None:
                out[strategy][rtt] = value
    return out


def worst_prompts(facet: Facet, strategy: str) -> dict[float, tuple[int, Estimate]]:
    """rtt -> (prompt, its speed-up over cloud-only) for the prompt where `strategy` does worst
    (each prompt's tokens/s averaged over its repeats): what "never slower on every prompt" is judged by.
    The interval resamples the prompt's repeats, both strategies' runs of a repeat together (they ran
    side by side): on a shared 2-core machine one run can differ from the next by a tenth, so the
    worst of many prompts sits well below 1 by chance alone, and the interval says how far."""
    base = cloud_strategy(facet.rows)
    if base is None:
        return {}
    worst: dict[float, tuple[int, Estimate]] = {}
    for prompt in sorted({r["prompt"] for r in facet.rows}):
        mine = [r for r in facet.rows if r["prompt"] == prompt]
        for rtt, ratio in _ratio_by_rtt(mine, strategy, base, [prompt]).items():
            if rtt in worst and ratio >= worst[rtt][1].value:
                continue
            at = [r for r in mine if r.get("rtt_ms") == rtt]
            repeats = sorted({r.get("repeat", 0) for r in at})

            def ratio_of(picked: list[int], at: list[dict] = at, rtt: float = rtt) -> float | None:
                rows = [dict(r, prompt=i) for i, rep in enumerate(picked) for r in at if r.get("repeat", 0) == rep]
                return _ratio_by_rtt(rows, strategy, base, list(range(len(picked)))).get(rtt)

            estimate = bootstrap_ci(repeats, ratio_of) or Estimate(ratio, ratio, ratio, len(repeats))
            worst[rtt] = (prompt, Estimate(ratio, min(estimate.lo, ratio), max(estimate.hi, ratio), len(repeats)))
    return worst


@dataclass(frozen=True)
class Crossover:
    """Where a hybrid strategy's speed-up falls to 1: an RTT with its interval, or why there is none."""

    estimate: Estimate | None
    verdict: str  # "crosses", "above" (never falls to 1 in the sweep), "below" (at or under 1 from the start)

    def text(self) -> str:
        if self.verdict == "above":
            return "above 1 throughout"
        if self.verdict == "below":
            return "at or below 1 already at the lowest RTT"
        e = self.estimate
        return f"{e.value:.0f} ms (95 % CI {e.lo:.0f}–{e.hi:.0f})"


def crossover(facet: Facet, strategy: str) -> Crossover | None:
    """The RTT where `strategy`'s speed-up over cloud-only falls to 1, with a bootstrap interval over
    prompts; None without a cloud-only strategy or with fewer than two RTTs."""
    base = cloud_strategy(facet.rows)
    prompts = sorted({r["prompt"] for r in facet.rows})
    if base is None:
        return None
    curve = _ratio_by_rtt(facet.rows, strategy, base, prompts)
    if len(curve) < 2:
        return None
    point = crossing(curve.items())
    if point is None:
        return Crossover(None, "above")
    if point == min(curve):
        return Crossover(None, "below")
    value = bootstrap_ci(prompts, lambda ps: crossing(_ratio_by_rtt(facet.rows, strategy, base, ps).items()))
    return Crossover(value, "crosses")


def paired_difference(rows: list[dict], a: str, b: str, field: str = "tokens_per_s") -> Estimate | None:
    """Mean of (a − b) over the prompts both ran (each prompt's mean over repeats), with a t interval."""
    pa = per_prompt([r for r in rows if r["strategy"] == a], field)
    pb = per_prompt([r for r in rows if r["strategy"] == b], field)
    shared = sorted(set(pa) & set(pb))
    if not shared:
        return None
    return mean_ci([pa[p] - pb[p] for p in shared])


def capacity(rows: list[dict]) -> dict[str, dict[int, tuple[Estimate, Estimate]]]:
    """strategy -> {edges -> (tokens/s per edge, tokens/s the cloud served to all edges at once)}.
    A group is the generations that ran concurrently (same strategy, point, prompt group and repeat);
    its served rate is their tokens over the longest of their wall times."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("rtt_ms") is not None and r.get("key"):
            groups[tuple(r["key"][:-1])].append(r)  # the key without the edge's place
    served: dict[tuple, list[float]] = defaultdict(list)
    per_edge: dict[tuple, list[float]] = defaultdict(list)
    for members in groups.values():
        strategy, edges = members[0]["strategy"], members[0]["edges"]
        served[strategy, edges].append(sum(r["new_tokens"] for r in members) / max(r["wall_s"] for r in members))
        per_edge[strategy, edges] += [r["tokens_per_s"] for r in members]
    out: dict[str, dict] = defaultdict(dict)
    for (strategy, edges), values in served.items():
        out[strategy][edges] = (mean_ci(per_edge[strategy, edges]), mean_ci(values))
    return dict(out)


def exactness(rows: list[dict]) -> tuple[int, int]:
    """(rows identical to the target's own greedy decoding, rows judged): every greedy row of every
    kind that crosses or replaces the target, each against the independent reference."""
    judged = [r for r in rows if r.get("same_as_target") is not None and r["kind"] != "edge_only"]
    return sum(bool(r["same_as_target"]) for r in judged), len(judged)
