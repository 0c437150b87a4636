"""An experiment, as written in experiments/<name>.yaml: models, prompts, the grid, the strategies."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common.config import ConfigError, read_mapping, route
from ..edge.config import EdgeConfig
from ..netem.config import NetemBackend
from ..netem.profiles import profile
from ..netem.shaping import LinkSpec
from ..netem.trace import load_trace

KINDS = {
    "hybrid": "edge drafts, the cloud pool verifies, through the emulated link",
    "cloud_only": "the target alone through the same link, as --cloud-only decodes: a session opened at the front "
                  "door, its tokens streamed from its replica (Decode)",
    "colocated": "drafter and target in one process on the cloud's core: speculative decoding, no network",
    "hf_assisted": "Hugging Face generate(assistant_model=...) on the cloud's core, the familiar reference",
    "edge_only": "the drafter alone on the edge's core (fast, lower quality)",
}
LINKED = ("hybrid", "cloud_only")  # strategies that cross the link; the others run once, without it
# The swept conditions and their values when a grid leaves them out. `link` names a preset of
# netem/profiles.py (it sets RTT, jitter, bandwidth and loss; the other link keys then add nothing)
# or `trace:FILE`, a recorded latency trace (netem/trace.py) that sets RTT and jitter;
# `drafter` replaces the experiment's drafter for strategies that do not name their own.
GRID_DEFAULTS = {"rtt_ms": 0, "jitter_ms": 0, "bandwidth_mbps": 0, "loss_pct": 0, "link": "", "temperature": 0,
                 "edges": 1, "drafter": ""}
GRID_KEYS = tuple(GRID_DEFAULTS)
TRACE_PREFIX = "trace:"  # a `link` value that replays a recorded latency trace
NETWORK_KEYS = ("rtt_ms", "jitter_ms", "bandwidth_mbps", "loss_pct", "link")  # meaningless without a link


@dataclass(frozen=True)
class Strategy:
    """One way to generate, compared with the others in the same run."""

    name: str
    kind: str
    edge: dict[str, Any] = field(default_factory=dict)  # EdgeConfig keys (hybrid, colocated, edge_only)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"strategy {self.name!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        try:
            route(EdgeConfig, self.edge)
        except ConfigError as exc:
            raise ConfigError(f"strategy {self.name!r}: {exc}") from None


@dataclass(frozen=True)
class GridPoint:
    """One combination of the swept conditions."""

    rtt_ms: float | None  # None (with the other network keys) for strategies that cross no link
    jitter_ms: float | None
    bandwidth_mbps: float | None
    loss_pct: float | None
    link: str | None
    temperature: float
    edges: int
    drafter: str


@dataclass(frozen=True)
class ExperimentSpec:
    """Everything `hybridspec experiment run` needs; see experiments/rtt_sweep.yaml for a commented one."""

    name: str
    strategies: tuple[Strategy, ...]
    grid: dict[str, list]
    vary: dict[str, list] = field(default_factory=dict)  # one at a time around the grid's first point
    target: str = ""  # "" = the embedded default
    drafter: str = ""
    prompts: Any = "heldout:16"  # heldout:N | freeform:N | a list of strings | {set name: one of those}
    chat: bool = True
    max_new_tokens: int = 64
    repeats: int = 3
    seed: int = 0
    pin: bool = True  # edge on one core, cloud on another, one torch thread each (needs 2 cores)
    cloud: dict[str, Any] = field(default_factory=dict)  # ServeConfig keys for the cloud side
    trace: bool = False  # write OUT/traces/*.jsonl: per-token times of one generation per strategy and point
    edge_processes: bool = False  # each concurrent edge in its own process (N devices), not a thread
    netem_backend: str = "relay"  # relay: the user-space TCP relay; tc: the kernel's netem qdisc on loopback

    def points(self) -> list[GridPoint]:
        """Every grid point, in sweep order: the product of `grid`, then each `vary` value alone, the
        other keys at the grid's first point (a one-factor-at-a-time design for many dimensions)."""
        values = [self.grid.get(k, [GRID_DEFAULTS[k]]) for k in GRID_KEYS]
        points = [GridPoint(*combo) for combo in itertools.product(*values)]
        base = dict(zip(GRID_KEYS, (v[0] for v in values)))
        for key, extra in self.vary.items():
            for value in extra:
                point = GridPoint(**{**base, key: value})
                if point not in points:
                    points.append(point)
        return points

    def prompt_texts(self) -> list[tuple[str, str]]:
        """The prompts, resolved: (set name, text) in order."""
        sets = self.prompts if isinstance(self.prompts, dict) else {"": self.prompts}
        return [(name, text) for name, source in sets.items() for text in _resolve_prompts(source)]


def _resolve_prompts(source: Any) -> list[str]:
    from ..distill.prompts import FREEFORM_PROMPTS, heldout_prompts

    if isinstance(source, list):
        return [str(p) for p in source]
    kind, _, count = str(source).partition(":")
    n = int(count or 16)
    if kind == "heldout":
        return heldout_prompts(n, seed=7)
    if kind == "freeform":
        if n > len(FREEFORM_PROMPTS):
            raise ConfigError(f"freeform:{n}: there are {len(FREEFORM_PROMPTS)} free-form prompts")
        return FREEFORM_PROMPTS[:n]
    raise ConfigError(f"prompts must be heldout:N, freeform:N, a list of strings or a mapping of set names to "
                      f"those, got {source!r}")


def load_spec(path: str | Path) -> ExperimentSpec:
    """Read and check an experiment file; every problem is a ConfigError naming the key."""
    p = Path(path)
    raw = read_mapping(p)
    known = {f.name for f in dataclasses.fields(ExperimentSpec)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown experiment key(s) in {p}: {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    strategies = raw.pop("strategies", None)
    if not strategies:
        raise ConfigError(f"{p}: `strategies` must list at least one strategy")
    grid, vary = (_grid_section(p, raw.pop(section, {}) or {}, section) for section in ("grid", "vary"))
    try:
        spec = ExperimentSpec(strategies=tuple(Strategy(**s) for s in strategies), grid=grid, vary=vary,
                              **{"name": p.stem, **raw})
    except TypeError as exc:
        raise ConfigError(f"{p}: {exc}") from None
    names = [s.name for s in spec.strategies]
    if len(set(names)) != len(names):
        raise ConfigError(f"{p}: strategy names must be unique")
    spec.prompt_texts()  # validates `prompts`
    if spec.cloud.get("direct_verify"):
        raise ConfigError(f"{p}: cloud.direct_verify would let rounds bypass the emulated link (the edge would "
                          "stream them to the replica's own port); experiments always run with it off")
    if spec.netem_backend not in {b.value for b in NetemBackend}:
        raise ConfigError(f"{p}: netem_backend must be one of {', '.join(b.value for b in NetemBackend)}, "
                          f"got {spec.netem_backend!r}")
    if spec.netem_backend == "tc" and any(str(link).startswith(TRACE_PREFIX) for section in (grid, vary)
                                          for link in section.get("link", [])):
        raise ConfigError(f"{p}: netem_backend tc cannot replay a latency trace; use the relay backend")
    for key in ("chat", "pin", "trace", "edge_processes"):
        if not isinstance(getattr(spec, key), bool):
            raise ConfigError(f"{p}: {key} must be true or false, got {getattr(spec, key)!r}")
    if spec.repeats < 1:
        raise ConfigError(f"{p}: repeats must be >= 1, got {spec.repeats}")
    return spec


def _grid_section(path: Path, section: dict, name: str) -> dict[str, list]:
    """A `grid` or `vary` mapping checked: known keys, known link profiles, readable traces, lists."""
    from ..netem.profiles import PROFILES
    from ..netem.trace import load_trace

    if not isinstance(section, dict):
        raise ConfigError(f"{path}: `{name}` must map grid keys to values")
    bad = sorted(set(section) - set(GRID_KEYS))
    if bad:
        raise ConfigError(f"{path}: unknown {name} key(s) {', '.join(bad)}; known: {', '.join(GRID_KEYS)}")
    section = {k: v if isinstance(v, list) else [v] for k, v in section.items()}
    for link in section.get("link", []):
        if str(link).startswith(TRACE_PREFIX):
            try:
                load_trace(link[len(TRACE_PREFIX):])
            except ValueError as exc:
                raise ConfigError(f"{path}: link {link!r}: {exc}") from None
        elif link and link not in PROFILES:
            raise ConfigError(f"{path}: unknown link {link!r}; known: {', '.join(PROFILES)} or {TRACE_PREFIX}FILE")
    return section


def link_spec(point: GridPoint) -> LinkSpec:
    """The emulated link of a grid point: its named profile, else its recorded trace (with the point's
    bandwidth and loss), else its RTT, jitter, bandwidth and loss."""
    if point.link and point.link.startswith(TRACE_PREFIX):
        return LinkSpec.symmetric(trace=load_trace(point.link[len(TRACE_PREFIX):]),
                                  bandwidth_mbps=point.bandwidth_mbps, loss_pct=point.loss_pct)
    if point.link:
        return profile(point.link).link_spec()
    return LinkSpec.symmetric(delay_ms=point.rtt_ms / 2, jitter_ms=point.jitter_ms,
                              bandwidth_mbps=point.bandwidth_mbps, loss_pct=point.loss_pct)
