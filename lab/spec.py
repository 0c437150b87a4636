"""An experiment, as written in experiments/<name>.yaml: models, prompts, the grid, the strategies."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common.config import ConfigError, read_mapping
from ..edge.config import EdgeConfig

KINDS = {
    "hybrid": "edge drafts, the cloud pool verifies, through the emulated link",
    "cloud_only": "the cloud's Generate stream through the same link (the target alone)",
    "colocated": "drafter and target in one process on the cloud's core: speculative decoding, no network",
    "hf_assisted": "Hugging Face generate(assistant_model=...) on the cloud's core, the familiar reference",
    "edge_only": "the drafter alone on the edge's core (fast, lower quality)",
}
LINKED = ("hybrid", "cloud_only")  # strategies that cross the link; the others run once, without it
GRID_KEYS = ("rtt_ms", "jitter_ms", "bandwidth_mbps", "temperature", "edges")


@dataclass(frozen=True)
class Strategy:
    """One way to generate, compared with the others in the same run."""

    name: str
    kind: str
    edge: dict[str, Any] = field(default_factory=dict)  # EdgeConfig keys (hybrid, colocated, edge_only)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"strategy {self.name!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        known = {f.name for f in dataclasses.fields(EdgeConfig)}
        unknown = sorted(set(self.edge) - known)
        if unknown:
            raise ConfigError(f"strategy {self.name!r}: unknown edge key(s) {', '.join(unknown)}")


@dataclass(frozen=True)
class GridPoint:
    """One combination of the swept conditions."""

    rtt_ms: float
    jitter_ms: float
    bandwidth_mbps: float
    temperature: float
    edges: int


@dataclass(frozen=True)
class ExperimentSpec:
    """Everything `hybridspec experiment run` needs; see experiments/rtt_sweep.yaml for a commented one."""

    name: str
    strategies: tuple[Strategy, ...]
    grid: dict[str, list]
    target: str = ""  # "" = the embedded default
    drafter: str = ""
    prompts: Any = "heldout:4"  # heldout:N | freeform:N | a list of strings
    chat: bool = True
    max_new_tokens: int = 64
    repeats: int = 1
    seed: int = 0
    pin: bool = True  # edge on one core, cloud on another, one torch thread each (needs 2 cores)
    cloud: dict[str, Any] = field(default_factory=dict)  # ServeConfig keys for the cloud side

    def points(self) -> list[GridPoint]:
        """Every grid point, in sweep order."""
        values = [self.grid.get(k, [d]) for k, d in zip(GRID_KEYS, (0, 0, 0, 0, 1))]
        return [GridPoint(*combo) for combo in itertools.product(*values)]

    def prompt_texts(self) -> list[str]:
        """The prompts, resolved."""
        from ..distill.prompts import FREEFORM_PROMPTS, heldout_prompts

        if isinstance(self.prompts, list):
            return [str(p) for p in self.prompts]
        kind, _, count = str(self.prompts).partition(":")
        n = int(count or 4)
        if kind == "heldout":
            return heldout_prompts(n, seed=7)
        if kind == "freeform":
            return FREEFORM_PROMPTS[:n]
        raise ConfigError(f"prompts must be heldout:N, freeform:N or a list of strings, got {self.prompts!r}")


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
    grid = raw.pop("grid", {}) or {}
    bad = sorted(set(grid) - set(GRID_KEYS))
    if bad:
        raise ConfigError(f"{p}: unknown grid key(s) {', '.join(bad)}; known: {', '.join(GRID_KEYS)}")
    grid = {k: v if isinstance(v, list) else [v] for k, v in grid.items()}
    try:
        spec = ExperimentSpec(strategies=tuple(Strategy(**s) for s in strategies), grid=grid,
                              **{"name": p.stem, **raw})
    except TypeError as exc:
        raise ConfigError(f"{p}: {exc}") from None
    names = [s.name for s in spec.strategies]
    if len(set(names)) != len(names):
        raise ConfigError(f"{p}: strategy names must be unique")
    spec.prompt_texts()  # validates `prompts`
    return spec
