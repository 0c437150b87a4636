"""`hybridspec pair check`: does a drafter fit a target, and does the pair pay, on this machine and on
a GPU? Measured here, then predicted with the edge's own speed-up model (edge/policy.py).

1. The files (common/models/pairing.py): vocabularies and special tokens identical, else one line
   naming the first difference, before any weights load; chat templates and context lengths compared.
2. The target on the engine `cloud serve` would pick (cloud/engine/factory.py): its pass costs
   t(1)..t(γmax + 1), timed as a replica times the curve it reports to edges (cloud/core/costs.py),
   and its greedy continuation of every prompt.
3. The drafter as the edge runs it (edge/drafters.py): greedy rounds of γmax drafts along each
   continuation, each round starting after the tokens the last one got accepted, give the acceptance
   α_j at each draft position (counted as the edge counts it, edge/estimates.py `observe_round`), the
   drafts accepted per round, and the per-token agreement over every position checked (distill's α,
   overall and per prompt: α_1 is lower, since a round mostly starts right after a rejection, and
   misses come in runs); and its costs d(k): drafting one token after k new ones (a round's first
   draft feeds the tokens the last round committed in one pass, its later drafts one token each).
4. The predictions: edge/policy.py's rate of hybrid decoding at the γ it would choose over cloud-only's
   1/T, with these α, a verify round costing rtt + t(γ + 1), T = t(1), and the drafter's time per
   drafted token t_d(γ) = (d(E(γ)) + (γ − 1)·d(1)) / γ: what the edge measures at that γ (a block's
   time over its length), E(γ) being the tokens a round commits. On a CPU a pass of a few tokens costs
   several of one (llama.cpp's one-row kernels), so a drafter that is cheap per token can still be
   dear in short blocks. On a GPU: the same drafter (the edge stays where it is) against the verify
   costs of the GPU suite's recorded pass table (docs/engine/gpu/, lab/gpu_suite) for the shape
   nearest the target's parameter count.

Free of torch at import: the CLI builds its flags from `PairCheckConfig`.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..cloud.core.limits import VerifierLimits
from ..common.config import check_fields, setting

# Built-in prompts: chat requests in everyday words, and code (what drafters find easiest to guess).
CHAT_PROMPTS = ("Explain in three sentences why the sky is blue.", "Give me three tips for better sleep.",
                "How do airplanes stay in the air?", "Summarize the plot of Romeo and Juliet.")
CODE_PROMPTS = ("Write a Python function that returns the n-th Fibonacci number.",
                "Write a Python function that checks whether a string is a palindrome.",
                "Write a SQL query that counts the orders of each customer in a table `orders`.",
                "Write a JavaScript function that removes duplicate values from an array.")
# What a verify round costs beyond the target's pass on one machine: the gRPC hop and the round's own
# work on both sides (docs/measurements.md, "The per-round hop": about 1.6 ms direct, 4.6 ms through the
# front door; `cloud serve`'s default is direct).
LOCAL_ROUND_MS = 2.0
GPU_RESULTS = Path(__file__).resolve().parents[1] / "docs" / "engine" / "gpu"  # the GPU suite's result files


@dataclass(frozen=True)
class PairCheckConfig:
    """What `hybridspec pair check` measures, and against what."""

    target: str = setting("", "the target: a .gguf file, a model directory or a cached hub id; empty: the "
                              "embedded target")
    drafter: str = setting("", "the drafter: a .gguf file, a drafter directory, a cached hub id or embedded:plain; "
                               "empty: the embedded default drafter")
    prompts: str = setting("", "a text file of prompts, one per line, each sent as one chat message when the "
                               "target has a chat template; empty: the built-in chat and code prompts")
    new_tokens: int = setting(48, "tokens the target writes after each prompt: the text acceptance is measured on",
                              ge=2)
    max_draft: int = setting(8, "the longest block drafted, and the longest the policy may choose", ge=1, le=16)
    rtt_ms: float = setting(LOCAL_ROUND_MS, "what a verify round costs beyond the target's pass: the link's round "
                                            "trip and the round's own work (on one machine, about 2 ms)", ge=0)
    max_context: int = setting(VerifierLimits.max_context, "the target's max_context as the cloud would serve it",
                               ge=1)
    threads: int = setting(1, "threads of the target and of the drafter each (what cloud serve and edge generate "
                              "use by default)", ge=1)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class Prediction:
    """Hybrid over cloud-only as the edge's policy sees it, for one set of costs."""

    where: str  # "this machine", or the GPU table used
    t_ms: tuple[float, ...]  # t(1)..t(γmax + 1): the target's pass of k tokens
    gamma: int  # the block length the policy picks
    draft_ms: float  # t_d at that γ: the drafter's time per drafted token
    speedup: float  # hybrid (at that γ, pipelined) over cloud-only
    choice: str  # what the edge would do: "hybrid" or "cloud-only" (hybrid must win by the policy's margin)


def load_prompts(path: str) -> list[str]:
    """The prompts of a file (one a line, blank lines skipped), or the built-in ones."""
    if not path:
        return [*CHAT_PROMPTS, *CODE_PROMPTS]
    lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        from ..common.config import ConfigError

        raise ConfigError(f"prompts file {path} holds no prompt")
    return lines


def check(cfg: PairCheckConfig, progress: Callable[[str, int], Callable[[], None]] | None = None) -> dict:
    """Check the pair and measure it; the report as a JSON-ready dict. `progress(label, total)` returns
    a function to call once per step done (None: silent). PairMismatch, before any weights load, when
    the drafter cannot draft for the target."""
    from ..common.models.embedded import resolve
    from ..common.models.pairing import check_pair, describe

    started = time.perf_counter()
    progress = progress or (lambda label, total: lambda: None)
    target_spec, drafter_spec = resolve(cfg.target, "target"), resolve(cfg.drafter, "drafter")
    # 1. The files alone: a drafter that cannot draft for the target stops here.
    target_files, drafter_files = describe(target_spec), describe(drafter_spec)
    fit = check_pair(target_files, drafter_files, cfg.max_context)
    prompts = load_prompts(cfg.prompts)
    # 2. The target on the cloud's engine: pass costs, then its own text.
    import torch

    torch.set_num_threads(cfg.threads)  # the drafter's sampling maths too: as `edge generate --torch-threads`
    engine, target = _target(target_spec, cfg)
    sizes = cfg.max_draft + 1
    step = progress("target: pass costs", 1)
    t_ms = _pass_costs(engine, target.vocab_size, sizes)
    step()
    ids = [_encode(target_files.tokenizer.directory, p) for p in prompts]
    eos = set(target.eos_token_ids)
    step = progress("target: writing", len(ids))
    texts = []
    for prompt in ids:
        texts.append(_continuation(engine, prompt, cfg.new_tokens, eos))
        step()
    # 3. The drafter as the edge drafts: rounds of γmax along the target's text.
    drafter = _drafter(drafter_spec, target.vocab_size, frozenset(eos), cfg)
    step = progress("drafter: rounds", sum(len(t) for t in texts))
    counts = draft_rounds(drafter, ids, texts, cfg.max_draft, step)
    alphas = counts.alphas(cfg.max_draft)
    step = progress("drafter: costs", 1)
    d_ms = _draft_costs(drafter, ids, texts, sizes)
    step()
    # 4. Predictions, here and on a GPU.
    here = predict(alphas, d_ms, cfg.rtt_ms / 1e3, t_ms, cfg.max_draft, "this machine")
    gpu = gpu_prediction(target_files.parameters, alphas, d_ms, cfg.rtt_ms / 1e3, cfg.max_draft)
    return {"target": target_spec, "drafter": drafter_spec, "engine": engine.capabilities.name,
            "weights": engine.capabilities.dtype, "threads": cfg.threads,
            "pair": {"vocab_size": fit.vocab_size, "special_tokens": list(fit.special_tokens),
                     "same_chat_template": fit.same_chat_template, "max_context": fit.context,
                     "target_context": target_files.context_length, "drafter_context": drafter_files.context_length,
                     "target_parameters": target_files.parameters, "notes": list(fit.notes)},
            "prompts": len(prompts), "target_tokens": sum(len(t) for t in texts), "rounds": counts.rounds,
            "acceptance": {"by_position": [round(a, 3) for a in alphas[:cfg.max_draft]],
                           "checked": counts.tries[:cfg.max_draft], "mean_accepted": round(counts.mean_accepted, 3),
                           "agreement": round(counts.agreement, 3),
                           "per_prompt": [round(a, 3) for a in counts.prompt_agreement]},
            "drafter_ms": list(d_ms), "target_pass_ms": list(t_ms), "c": round(d_ms[0] / t_ms[0], 3),
            "rtt_ms": cfg.rtt_ms,
            "here": asdict(here), "gpu": asdict(gpu) if gpu else None,
            "seconds": round(time.perf_counter() - started, 1)}


def predict(alphas: list[float], d_ms: tuple[float, ...], rtt_s: float, t_ms: tuple[float, ...], max_draft: int,
            where: str) -> Prediction:
    """Hybrid over cloud-only by edge/policy.py at the best γ, with verify rounds of rtt + t(γ + 1),
    T = t(1) and the drafter's time per drafted token at each γ from its costs d(k) (module docstring)."""
    from dataclasses import replace

    from ..edge.policy import Rates, cloud_only_rate, expected_tokens, hybrid_rate, interpolate, prefer_cloud_only

    curve = tuple(t / 1e3 for t in t_ms)
    rates = Rates(alphas=alphas, draft_s=d_ms[0] / 1e3, rtt_s=rtt_s, verify_single_s=curve[0],
                  verify_block_s=curve[-1], verify_per_draft_s=0.0, cloud_token_s=curve[0], verify_curve_s=curve)
    drafts = list(enumerate(d_ms, 1))

    def at(gamma: int) -> Rates:
        first = interpolate(drafts, expected_tokens(alphas, gamma))  # the round's first draft feeds E(γ) tokens
        return replace(rates, draft_s=(first + (gamma - 1) * d_ms[0]) / gamma / 1e3)

    gamma = max(range(1, max_draft + 1), key=lambda g: hybrid_rate(at(g), g, True))
    best = at(gamma)
    rate = hybrid_rate(best, gamma, True)
    stays = prefer_cloud_only(best, max_draft, True, now_cloud_only=True, hybrid=rate)
    return Prediction(where, tuple(round(t, 3) for t in t_ms), gamma, round(best.draft_s * 1e3, 3),
                      round(rate / cloud_only_rate(best), 3), "cloud-only" if stays else "hybrid")


def gpu_prediction(parameters: int, alphas: list[float], d_ms: tuple[float, ...], rtt_s: float,
                   max_draft: int) -> Prediction | None:
    """The prediction against the GPU suite's pass table for the shape nearest `parameters` (one
    session's passes), the drafter staying on this machine; None without a recorded table."""
    from ..edge.policy import interpolate

    tables = gpu_tables()
    if not tables or not parameters:
        return None
    shape = min(tables, key=lambda s: abs(math.log(tables[s]["parameters"] / parameters)))
    table = tables[shape]
    t_ms = tuple(interpolate(table["points"], k) for k in range(1, max_draft + 2))
    return predict(alphas, d_ms, rtt_s, t_ms, max_draft,
                   f"{table['device']}, shape {shape} ({table['parameters'] / 1e9:.2f} B parameters), {table['file']}")


def gpu_tables(results: Path = GPU_RESULTS) -> dict[str, dict]:
    """Per model shape, the newest recorded one-session pass table of the GPU suite: (tokens, ms) points,
    the device, the file, and the shape's parameter count."""
    from .gpu_suite.models import SHAPES

    tables: dict[str, dict] = {}
    for path in sorted(results.glob("*.json")) if results.is_dir() else ():
        result = json.loads(path.read_text())
        date = result.get("meta", {}).get("date", "")
        for shape, engines in (result.get("passes") or {}).items():
            rows = sorted((r["tokens"], r["ms"]) for r in engines.get("torch", []) if r["sessions"] == 1)
            if shape in SHAPES and rows and date >= tables.get(shape, {}).get("date", ""):
                tables[shape] = {"date": date, "points": rows, "file": f"docs/engine/gpu/{path.name}",
                                 "device": result["meta"].get("device_name", "GPU"),
                                 "parameters": shape_parameters(SHAPES[shape])}
    return tables


def shape_parameters(shape: dict) -> int:
    """A Llama shape's parameter count (lab/gpu_suite/models.py SHAPES: embeddings, layers, head)."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim") or h // heads
    layer = 2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * i + 2 * h
    return v * h * (1 if shape["tie_word_embeddings"] else 2) + shape["num_hidden_layers"] * layer + h


@dataclass
class RoundCounts:
    """Greedy rounds along the target's text: per draft position, drafts checked and accepted (the
    edge's α_j without its prior and decay), and per prompt, drafts checked and accepted at any position."""

    tries: list[int]
    hits: list[int]
    rounds: int = 0
    accepted: int = 0
    prompt_tries: list[int] = field(default_factory=list)
    prompt_hits: list[int] = field(default_factory=list)

    def alphas(self, max_draft: int) -> list[float]:
        """α_1..α_{γmax + 1}: a position never reached takes the one before it (the bonus guess of a
        block of γmax, α_{γmax + 1}, is never measured: it is taken as α_γmax)."""
        out: list[float] = []
        for j in range(max_draft + 1):
            tries = self.tries[j] if j < len(self.tries) else 0
            out.append(self.hits[j] / tries if tries else (out[-1] if out else 0.0))
        return out

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per round."""
        return self.accepted / max(1, self.rounds)

    @property
    def agreement(self) -> float:
        """Per token: of the text's positions the rounds checked, the share where the draft was the
        target's token. Along an accepted run the drafter's context is the target's text, so this is
        distill's greedy acceptance α (distill/evaluate.py) over the same positions."""
        return sum(self.hits) / max(1, sum(self.tries))

    @property
    def prompt_agreement(self) -> list[float]:
        """`agreement` of each prompt's text."""
        return [h / max(1, t) for h, t in zip(self.prompt_hits, self.prompt_tries)]


def draft_rounds(drafter, prompts: list[list[int]], texts: list[list[int]], max_draft: int,
                 step: Callable[[], None] | None = None) -> RoundCounts:
    """Greedy rounds along each target text as the edge runs them: draft up to `max_draft` after the
    committed text, count what the text accepts, commit the accepted drafts and the target's next token.
    The text's last token is never drafted: it is the verifier's, as the last of a generation's budget
    is (edge/generation.py), so a draft is only ever checked against a token the target wrote; these
    are then exactly distill's rounds replayed from teacher-forced flags (distill/evaluate.py `replay`)."""
    step = step or (lambda: None)
    counts = RoundCounts([0] * max_draft, [0] * max_draft)
    for prompt, text in zip(prompts, texts):
        done = tries = hits = 0
        while done < len(text):
            block = min(max_draft, len(text) - done - 1)
            drafts = drafter.propose(prompt + text[:done], block, fallback=False).ids if block else []
            kept = next((j for j, (a, b) in enumerate(zip(drafts, text[done:])) if a != b), len(drafts))
            checked = min(kept + 1, len(drafts))
            for j in range(checked):
                counts.tries[j] += 1
                counts.hits[j] += j < kept
            counts.rounds += 1
            counts.accepted += kept
            tries, hits = tries + checked, hits + kept
            done += kept + 1
            for _ in range(kept + 1):
                step()
        counts.prompt_tries.append(tries)
        counts.prompt_hits.append(hits)
    return counts


REPEATS = 3  # timings of each drafter cost; the fastest is kept (the least disturbed, as for t(k))


def _draft_costs(drafter, prompts: list[list[int]], texts: list[list[int]], sizes: int) -> tuple[float, ...]:
    """d(1)..d(sizes) in ms: the drafter's time to draft one token after k tokens it has not seen
    (fed in one pass), over a context it holds; timed as edge/hybrid.py times a block."""
    longest = max(range(len(texts)), key=lambda i: len(texts[i]))
    context = prompts[longest] + texts[longest][:len(texts[longest]) // 2]
    news = texts[longest][len(texts[longest]) // 2:] * sizes  # tokens of the text, repeated if short
    times: dict[int, list[float]] = {k: [] for k in range(1, sizes + 1)}
    drafter.propose(context, 1, fallback=False)  # the context cached
    for _ in range(REPEATS):
        for k in times:
            started = time.perf_counter()
            drafter.propose(context + news[:k], 1, fallback=False)
            times[k].append((time.perf_counter() - started) * 1e3)
            drafter.propose(context, 1, fallback=False)  # back to the context (a cut: nothing fed but its last)
    return tuple(round(min(times[k]), 3) for k in times)


def _target(spec: str, cfg: PairCheckConfig):
    """(engine, target) as `cloud serve` loads them, with room for one session."""
    from ..cloud.engine.factory import load_engine
    from ..cloud.engine.kinds import EngineKind
    from ..common.config import DEVICE_AUTO, DType

    limits = VerifierLimits(max_context=cfg.max_context, max_sessions=1, kv_cache_tokens=cfg.max_context,
                            kv_streams=1, max_tree_nodes=0, prefix_cache_tokens=0)
    target, engine = load_engine(spec, EngineKind.AUTO, DEVICE_AUTO, DType.AUTO, cfg.threads, limits)
    return engine, target


def _pass_costs(engine, vocab_size: int, sizes: int) -> tuple[float, ...]:
    """t(1)..t(sizes) in ms, as a replica measures its curve (every size up to 8, interpolated beyond)."""
    from ..cloud.core.costs import measure_pass_costs
    from ..edge.policy import interpolate

    points = measure_pass_costs(engine, vocab_size, sizes)
    return tuple(round(interpolate(points, k), 3) for k in range(1, sizes + 1))


def _encode(tokenizer_dir: Path, text: str) -> list[int]:
    """A prompt as the edge encodes it: one chat message where the tokenizer has a chat template."""
    from ..edge.textcodec import TextCodec

    codec = TextCodec(tokenizer_dir)
    return codec.encode_chat([{"role": "user", "content": text}]) if codec.chat_template else codec.encode(text)


def _continuation(engine, prompt: list[int], new_tokens: int, eos: set[int]) -> list[int]:
    """The target's greedy continuation of `prompt` on `engine`, up to `new_tokens` or an end id."""
    import torch

    from ..cloud.engine.base import Feed

    kv = engine.new_sequence()
    try:
        engine.reserve(kv, len(prompt) + new_tokens)
        for start in range(0, len(prompt) - 1, 256):
            engine.forward([Feed(kv, prompt[start:min(start + 256, len(prompt) - 1)], scored=False)])
        out: list[int] = []
        token = prompt[-1]
        while len(out) < new_tokens:
            logits = engine.forward([Feed(kv, [token], scored=True)])[0].logits
            token = int(torch.argmax(logits[-1]).item())
            out.append(token)
            if token in eos:
                break
        return out
    finally:
        engine.release(kv)


def _drafter(spec: str, vocab_size: int, stop_ids: frozenset[int], cfg: PairCheckConfig):
    """The drafter as `edge generate` runs it, drafting greedily."""
    from ..common.config import ConfigError
    from ..common.models.loading import load_drafter
    from ..common.protocol.wire import SamplingParams
    from ..edge.drafters import make_drafter
    from ..edge.proposal import DraftSettings, DrafterKind

    loaded = load_drafter(spec, "auto", "auto", "auto", cfg.threads)
    if loaded.is_eagle:
        raise ConfigError(f"{spec} is an EAGLE head, which drafts from the verifier's features: pair check "
                          "measures drafter LMs")
    settings = DraftSettings(sampling=SamplingParams(temperature=0.0), vocab_size=vocab_size, stop_ids=stop_ids,
                             max_context=cfg.max_context)
    return make_drafter(DrafterKind.MODEL, loaded, settings)
