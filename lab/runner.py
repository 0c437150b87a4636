"""Runs an experiment: the cloud pool, an emulated link per grid point, edges, and the baselines.

Results go to OUT/results.jsonl, one row per generation, appended as they finish; a run that is
interrupted and started again skips the rows already there (resume). OUT/results.csv is rewritten
from all rows at the end and OUT/meta.json records the spec and the environment.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..cloud.process import start_cloud_process, stop_cloud_process
from ..common.config import route
from ..common.models.embedded import resolve
from ..common.models.loading import LoadedModel, load_model
from ..edge.config import EdgeConfig
from ..edge.prompt import encode_prompt
from ..netem.relay import BackgroundLink
from ..netem.tc import TcError, TcLink, probe
from . import baselines
from .edges import ProcessSlot, Slot
from .references import load_references, served_verifier
from .rows import done_keys, row_key, write_csv
from .spec import LINKED, ExperimentSpec, GridPoint, Strategy, link_spec


class Lab:
    """One experiment's run: models, cores, the cloud process, and the results file."""

    def __init__(self, spec: ExperimentSpec, out: Path) -> None:
        if spec.netem_backend == "tc" and (reason := probe()):  # before minutes of loading and references
            raise TcError(f"netem_backend tc does not work here: {reason} (the kernel needs sch_prio and sch_netem, "
                          "and tc needs root); use netem_backend: relay")
        self.spec = spec
        self.out = out
        self.target_path = resolve(spec.target, "target")
        self.drafter_path = resolve(spec.drafter, "drafter")
        cores = sorted(os.sched_getaffinity(0))
        self.pin = spec.pin and len(cores) >= 2
        self.edge_cores = {cores[0]} if self.pin else set(cores)
        self.cloud_cores = {cores[1]} if self.pin else set(cores)
        self.drafter = load_model(self.drafter_path, device="cpu")
        texts = spec.prompt_texts()
        self.prompt_sets = [name for name, _ in texts]
        self.prompts = [encode_prompt(self.drafter.tokenizer, text, spec.chat) for _, text in texts]
        self.rows_file = out / "results.jsonl"
        self.done = done_keys(self.rows_file)
        self.references_file = out / "references.json"
        self.references: dict[int, list[int]] = {}  # prompt -> the served engine's own greedy tokens
        self._local: dict[str, object] = {}  # target, verifier, assistant for the local baselines
        self._drafters: dict[str, LoadedModel] = {self.drafter_path: self.drafter}  # a strategy may name its own

    # ---- the sweep --------------------------------------------------------------------------

    def run(self) -> int:
        """Run every missing row; returns how many were run."""
        spec = self.spec
        todo = [(p, s) for p in spec.points() for s in spec.strategies if s.kind in LINKED] + \
               [(p, s) for p in self._local_points() for s in spec.strategies if s.kind not in LINKED]
        total = sum(self._count(p, s) for p, s in todo)
        if total == 0:
            return 0
        self._write_meta()
        if self.pin:
            os.sched_setaffinity(0, self.edge_cores)
            torch.set_num_threads(1)
        self._load_references()
        ran = 0
        with tqdm(total=total, desc=f"experiment {spec.name}", unit="generation") as bar:
            linked = [(p, s) for p, s in todo if s.kind in LINKED and self._count(p, s)]
            if linked:
                # Rounds must cross the emulated link: a replica's own endpoint (direct verify) would
                # take them straight from the edge, around the relay.
                cloud_config = {"target": self.target_path, **({"torch_threads": 1} if self.pin else {}),
                                **spec.cloud, "direct_verify": False}
                proc, address, log = start_cloud_process(cloud_config, self.cloud_cores if self.pin else None)
                try:
                    first = linked[0][0]
                    self._warm_up(first, [s for p, s in linked if p == first], address)
                    for point in spec.points():
                        jobs = [s for p, s in linked if p == point]
                        if jobs:
                            ran += self._run_linked(point, jobs, address, bar)
                finally:
                    stop_cloud_process(proc)
            for point, strategy in todo:
                if strategy.kind not in LINKED and self._count(point, strategy):
                    ran += self._run_local(point, strategy, bar)
        return ran

    def _local_points(self) -> list[GridPoint]:
        """Baselines without a link run once per temperature and drafter."""
        seen = {(p.temperature, p.drafter) for p in self.spec.points()}
        return [GridPoint(rtt_ms=None, jitter_ms=None, bandwidth_mbps=None, loss_pct=None, link=None, temperature=t,
                          edges=1, drafter=d) for t, d in sorted(seen)]

    # ---- the independent reference ----------------------------------------------------------

    def _load_references(self) -> None:
        """The served engine's own greedy decoding of every prompt, on the cloud's core (lab/references.py)."""
        if not any(p.temperature == 0 for p in self.spec.points()):
            return
        if self.pin:
            os.sched_setaffinity(0, self.cloud_cores)
        try:
            self.references = load_references(self.references_file, self.prompts, self.spec.max_new_tokens,
                                              self._verifier())
        finally:
            if self.pin:
                os.sched_setaffinity(0, self.edge_cores)

    def _keys(self, point: GridPoint, strategy: Strategy) -> list[tuple]:
        """Rows a (point, strategy) pair produces. Over the link, edges run in groups of `edges`
        concurrent generations, keyed by the group's first prompt and the edge's place in it."""
        repeats, n = range(self.spec.repeats), len(self.prompts)
        if strategy.kind in LINKED:
            return [row_key(strategy.name, point, first, repeat, edge) for repeat in repeats
                    for first in range(0, n, point.edges) for edge in range(point.edges)]
        return [row_key(strategy.name, point, prompt, repeat, 0) for repeat in repeats for prompt in range(n)]

    def _count(self, point: GridPoint, strategy: Strategy) -> int:
        return sum(k not in self.done for k in self._keys(point, strategy))

    # ---- strategies over the link -----------------------------------------------------------

    def _run_linked(self, point: GridPoint, strategies: list[Strategy], address: str, bar) -> int:
        """Every strategy on each prompt (group) in turn, the order rotating, so that the machine's drift
        lands on all strategies alike and a prompt's speed-up compares runs seconds apart. The rotation
        counts repeats as well as prompts: by prompts alone, an even number of prompts gave each prompt
        the same order in every repeat, so a drift between a prompt's two runs always fell the same way."""
        ran = 0
        with self._link(point, address) as link:
            # One edge per concurrent slot and strategy, kept across prompts: like a device serving many
            # requests, it keeps its connection and its measured rates from one generation to the next.
            slots = self._slots(point, strategies, link.address)
            try:
                for repeat in range(self.spec.repeats):
                    for group, first in enumerate(range(0, len(self.prompts), point.edges), start=1):
                        turn = (group + repeat) % len(strategies)
                        for strategy in strategies[turn:] + strategies[:turn]:
                            keys = [row_key(strategy.name, point, first, repeat, e) for e in range(point.edges)]
                            if all(k in self.done for k in keys):
                                continue
                            rows = self._concurrent(point, strategy, slots, first, repeat)
                            for key, row in zip(keys, rows):
                                self._record(key, row)
                            ran += len(rows)
                            bar.update(len(rows))
            finally:
                for slot in slots:
                    slot.close()
        return ran

    def _warm_up(self, point: GridPoint, strategies: list[Strategy], address: str) -> None:
        """Untimed generations before the first timed one: each strategy once, then every other prompt
        once. A new cloud's first session and this process's first edge pay one-time costs (the first
        generation of each never_slower run of 2026-11-27 waited 260-320 ms longer for its first token
        than the cloud-only one beside it), and the first run of a prompt prefills what the replica's
        prefix cache then holds for the next (120 ms against 41 ms to the first token); both would land
        on whichever strategy the rotation puts first."""
        with self._link(point, address) as link:
            slot = Slot(self, strategies, point, link.address)
            try:
                runs = [(s, self.prompts[0]) for s in strategies] + [(strategies[0], p) for p in self.prompts[1:]]
                for strategy, prompt in runs:
                    try:
                        slot.generate(strategy.name, prompt, 0, None)
                    except Exception as exc:  # the timed generations will record it, if it lasts
                        tqdm.write(f"warm-up generation of {strategy.name} failed: {type(exc).__name__}: {exc}")
            finally:
                slot.close()

    def _slots(self, point: GridPoint, strategies: list[Strategy], address: str) -> list:
        """The point's concurrent edge slots: in this process, or each in its own (edge_processes)."""
        if not self.spec.edge_processes:
            return [Slot(self, strategies, point, address) for _ in range(point.edges)]
        slots = [ProcessSlot(Lab, self.spec, self.out, strategies, point, address) for _ in range(point.edges)]
        for slot in slots:
            slot.wait_ready()  # started together: their imports and model loads overlap
        return slots

    def _link(self, point: GridPoint, upstream: str) -> BackgroundLink | TcLink:
        """The grid point's link to the cloud's front door, by the experiment's netem backend."""
        if self.spec.netem_backend == "tc":
            return TcLink(link_spec(point), upstream)
        return BackgroundLink(link_spec(point), upstream, seed=self.spec.seed)

    def _concurrent(self, point: GridPoint, strategy: Strategy, slots: list, first: int, repeat: int) -> list[dict]:
        """Each slot's edge of `strategy` generates for its own prompt, all at once."""
        rows: list[dict] = [{} for _ in slots]

        def one(i: int) -> None:
            prompt = (first + i) % len(self.prompts)
            try:
                rows[i] = slots[i].generate(strategy.name, self.prompts[prompt], repeat,
                                            self._trace_file(point, strategy, first + i, repeat))
            except Exception as exc:  # recorded, so one failed generation does not end the sweep
                rows[i] = {"error": f"{type(exc).__name__}: {exc}"}
            rows[i].update(edge=i, prompt=prompt)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(slots))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [self._row(point, strategy, r, repeat) for r in rows]

    # ---- strategies without a link ----------------------------------------------------------

    def _run_local(self, point: GridPoint, strategy: Strategy, bar) -> int:
        if self.pin:  # the cloud's core: what the user would run on the cloud host alone
            os.sched_setaffinity(0, self.edge_cores if strategy.kind == "edge_only" else self.cloud_cores)
        ran = 0
        try:
            for repeat in range(self.spec.repeats):
                for prompt_index, prompt in enumerate(self.prompts):
                    key = row_key(strategy.name, point, prompt_index, repeat, 0)
                    if key in self.done:
                        continue
                    cfg = self.edge_config(strategy, point, "", repeat)
                    try:
                        result = self._local_once(strategy, prompt, cfg)
                        raw = {"tokens": result.tokens, "wall_s": result.wall_s, **result.stats}
                    except Exception as exc:
                        raw = {"error": f"{type(exc).__name__}: {exc}"}
                    raw.update(edge=0, prompt=prompt_index)
                    self._record(key, self._row(point, strategy, raw, repeat))
                    ran += 1
                    bar.update(1)
        finally:
            if self.pin:
                os.sched_setaffinity(0, self.edge_cores)
        return ran

    def drafter_for(self, cfg: EdgeConfig) -> tuple[LoadedModel, LoadedModel | None]:
        """The drafter a strategy names ("" = the experiment's), and for an eagle head its fallback."""
        drafter = self._load(resolve(cfg.model.drafter, "drafter") if cfg.model.drafter else self.drafter_path)
        if not drafter.is_eagle or cfg.model.fallback_drafter == "ngram":
            return drafter, None
        return drafter, self._load(resolve(cfg.model.fallback_drafter, "plain"))

    def _load(self, path: str) -> LoadedModel:
        """A drafter, loaded once per experiment."""
        if path not in self._drafters:
            self._drafters[path] = load_model(path, device="cpu")
        return self._drafters[path]

    def _local_once(self, strategy: Strategy, prompt: list[int], cfg: EdgeConfig) -> baselines.LocalRun:
        if strategy.kind == "edge_only":
            info = self._verifier().info
            return baselines.edge_only(self.drafter_for(cfg)[0], info.vocab_size, info.eos_token_ids, prompt, cfg)
        if strategy.kind == "colocated":
            return baselines.colocated(self._verifier(), self.drafter_for(cfg)[0], prompt, cfg)
        return baselines.hf_assisted(self._target(), self._assistant(), prompt, cfg)

    def _target(self) -> LoadedModel:
        if "target" not in self._local:
            self._local["target"] = load_model(self.target_path, device="cpu")
        return self._local["target"]

    def _verifier(self):
        if "verifier" not in self._local:
            self._local["verifier"] = served_verifier(self.target_path, self.spec.cloud)
        return self._local["verifier"]

    def _assistant(self):
        """The drafter as a full-vocabulary model, as transformers' assisted generation needs."""
        from ..common.models import compact
        from ..common.models.manifest import is_compact

        if "assistant" not in self._local:
            path = Path(self.drafter_path if not self.drafter.is_eagle else resolve("", "plain"))
            if is_compact(path):
                model, _, _ = compact.load_compact(path, torch.float32, full_head=True)
                self._local["assistant"] = model.eval()
            else:
                self._local["assistant"] = self._load(str(path)).model
        return self._local["assistant"]

    # ---- rows -------------------------------------------------------------------------------

    def edge_config(self, strategy: Strategy, point: GridPoint, address: str, repeat: int) -> EdgeConfig:
        values = {"cloud": address or "127.0.0.1:1", "max_new_tokens": self.spec.max_new_tokens,
                  "temperature": point.temperature, "seed": self.spec.seed + repeat,
                  "torch_threads": 1 if self.pin else 0, "drafter": point.drafter, **strategy.edge}
        return EdgeConfig.of(**values)

    def _row(self, point: GridPoint, strategy: Strategy, raw: dict, repeat: int) -> dict:
        tokens = raw.pop("tokens", [])
        row = {"experiment": self.spec.name, "strategy": strategy.name, "kind": strategy.kind,
               **dataclasses.asdict(point), "repeat": repeat, "new_tokens": len(tokens), **raw}
        if "wall_s" in row:
            row["tokens_per_s"] = len(tokens) / row["wall_s"] if row["wall_s"] else 0.0
        row["prompt_set"] = self.prompt_sets[row["prompt"]]
        own = route(EdgeConfig, strategy.edge).get("model", {}).get("drafter")  # flat or nested under model
        row["drafter_used"] = (own or point.drafter or self.spec.drafter or "default") \
            if strategy.kind != "cloud_only" else ""
        # Hugging Face's assisted generation decodes with torch: comparable only to a torch reference.
        torch_text = strategy.kind == "hf_assisted" and self._verifier().engine.capabilities.name != "torch"
        if point.temperature == 0 and tokens and row["prompt"] in self.references and not torch_text:
            row["same_as_target"] = tokens == self.references[row["prompt"]]
        row["tokens"] = tokens
        return row

    def _record(self, key: tuple, row: dict) -> None:
        row["key"] = list(key)
        with self.rows_file.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.done.add(key)

    def _trace_file(self, point: GridPoint, strategy: Strategy, prompt: int, repeat: int) -> Path | None:
        """Where this generation's per-token trace goes: with `trace: true`, the first prompt's first
        repeat of every strategy at every point."""
        if not self.spec.trace or prompt != 0 or repeat != 0:
            return None
        folder = self.out / "traces"
        folder.mkdir(exist_ok=True)
        name = "_".join(str(v) for v in row_key(strategy.name, point, prompt, repeat, 0)[:-3]).replace("/", "-")
        return folder / f"{name}.jsonl"

    def _write_meta(self) -> None:
        import grpc
        import ray
        import transformers

        meta = {"spec": dataclasses.asdict(self.spec), "target": self.target_path, "drafter": self.drafter_path,
                "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "pinned": self.pin,
                "edge_cores": sorted(self.edge_cores), "cloud_cores": sorted(self.cloud_cores),
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
                "versions": {"python": platform.python_version(), "torch": torch.__version__,
                             "transformers": transformers.__version__, "ray": ray.__version__,
                             "grpcio": grpc.__version__},
                "git": _git_commit()}
        (self.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def run_experiment(spec: ExperimentSpec, out: Path, fresh: bool = False) -> Path:
    """Run (or resume) the experiment into `out`; returns the results file."""
    out.mkdir(parents=True, exist_ok=True)
    if fresh and (out / "results.jsonl").exists():
        (out / "results.jsonl").unlink()
    lab = Lab(spec, out)
    lab.run()
    write_csv(lab.rows_file, out / "results.csv")
    return lab.rows_file


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
