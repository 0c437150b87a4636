"""Long conversations, as a chat service sees them, through the llama.cpp engine: a long system prompt
every session starts with, and multi-turn histories of a few thousand tokens; all greedy.

long and prefix run `cloud serve`'s defaults on core 1, the edges on core 0; every strategy's tokens
must equal cloud-only's, and the prefix cache must change no token. swap parks and restores sessions
on one 4,096-cell stream: the restored session's tokens and first logits must equal those before.
docs/engine.md#long-conversations-parking-and-memory has the method and the numbers.
"""
from __future__ import annotations

import json
import os
import time
import urllib.request

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from hybridspec.cloud.core.limits import VerifierLimits
from hybridspec.cloud.engine.base import Feed
from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.gguf import GgufTarget, find_gguf, served_weights
from hybridspec.common.models.loading import load_model
from hybridspec.common.protocol.wire import GenerateSpec
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.prompt import encode_messages
from hybridspec.edge.generation import EventKind
from hybridspec.edge.worker import EdgeWorker
from harness import arguments, cloud, free_port, header, median, report

# An operator's system prompt of the usual kind: with the chat template's header, the prompts of
# chat() share their first 525 tokens, what every session of a chat service starts with.
SYSTEM_PROMPT = " ".join([
    "You are Atlas, the assistant of a public library's help desk. You answer questions from members of the public,",
    "most of them adults, some of them students working on school assignments. Follow these rules in every answer.",
    "1. Be accurate. If you are not sure of a fact, say so plainly instead of guessing, and suggest where the reader",
    "could check it: an encyclopedia, the library catalogue, or a librarian at the desk. 2. Be brief. Most questions",
    "deserve a short paragraph; a list is fine when the reader asked for steps or for several items. Never pad an",
    "answer with repetitions of the question. 3. Be kind and neutral. Do not take sides on political or religious",
    "questions; describe the main views fairly when a reader asks about them, and point to balanced sources. 4.",
    "Protect privacy. Never ask for or repeat a reader's address, phone number, library card number or any other",
    "personal detail. If a reader shares one, do not store or repeat it. 5. Help with learning, not cheating. For",
    "homework, explain the idea and show a worked example of a similar problem rather than writing the assignment",
    "for the student. 6. Library services: members may borrow up to twenty items at a time for three weeks, renew",
    "twice unless someone else has reserved the item, and return items at any branch. Late returns cost nothing for",
    "children's books and a small daily fee for other items, capped at the item's price. Study rooms can be booked a",
    "week ahead for up to two hours a day. Printing costs ten cents a page in black and white and fifty cents in",
    "colour. The makerspace needs a short safety course before first use. 7. Opening hours: the central branch opens",
    "at nine in the morning and closes at eight in the evening on weekdays, and opens from ten to five on Saturdays;",
    "it is closed on Sundays and public holidays. Neighbourhood branches keep shorter hours, listed on the library's",
    "website. 8. Accessibility: every branch has step-free access, large-print books and audio books; screen readers",
    "are installed on the public computers of the central branch, and staff can help members who need assistance",
    "with the catalogue. 9. When a question is outside what a library help desk can answer, such as medical, legal",
    "or financial advice for a reader's own situation, give general information only and recommend asking a",
    "qualified professional. 10. Never invent catalogue entries, opening hours, fees or events that are not listed",
    "above: say so.",
])


def chat(tokenizer, question: str, system: str = SYSTEM_PROMPT, history: list[tuple[str, str]] = ()) -> list[int]:
    """Token ids of a conversation: the system prompt, earlier (question, answer) turns, then a question."""
    messages = [{"role": "system", "content": system}]
    for asked, answered in history:
        messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
    return encode_messages(tokenizer, [*messages, {"role": "user", "content": question}])


def long_conversation(tokenizer, tokens: int, question: str) -> list[int]:
    """A conversation of about `tokens` tokens: the system prompt and as many earlier turns as fit
    (questions from the free-form set, answered at length), then `question`."""
    history: list[tuple[str, str]] = []
    turn = 0
    while True:
        asked = FREEFORM_PROMPTS[turn % len(FREEFORM_PROMPTS)]
        answered = " ".join(FREEFORM_PROMPTS[(turn + k) % len(FREEFORM_PROMPTS)] for k in range(1, 6))
        longer = chat(tokenizer, question, history=[*history, (asked, answered)])
        if len(longer) > tokens:
            return chat(tokenizer, question, history=history)
        history.append((asked, answered))
        turn += 1


STRATEGIES = {"cloud-only": {"cloud_only": True}, "default-edge": {},
              "hybrid-g4": {"cloud_only_switch": False, "gamma_policy": "fixed", "max_draft": 4, "tree_nodes": 0}}


def generate(drafter, address: str, prompt: list[int], new_tokens: int, settings: dict) -> dict:
    """One generation by a fresh edge worker with the edge's defaults (its timeout included, as a user
    runs it): its tokens, time to first token and wall time."""
    config = EdgeConfig.of(cloud=address, max_new_tokens=new_tokens, **settings)
    with VerifierClient(address, timeout_s=config.link.timeout_s) as client:
        worker = EdgeWorker(drafter, client, config)
        start, first = time.perf_counter(), None
        gen = worker.stream(prompt)
        for event in gen:
            if first is None and event.kind is EventKind.COMMIT and event.tokens:
                first = time.perf_counter() - start
    return {"tokens": gen.token_ids, "ttft_s": round(first or 0.0, 2), "wall_s": round(gen.stats.wall_s, 2),
            "rounds": gen.stats.rounds, "cloud_only_tokens": gen.stats.cloud_only_tokens, "error": gen.error}


def counters(port: int) -> dict[str, float]:
    """The front door's prefix-cache counters."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    wanted = ("hybridspec_prefix_cache_queries_total", "hybridspec_prefix_cache_hits_total",
              "hybridspec_prefix_cache_tokens_saved_total")
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] in wanted}


def prefix_run(prompts: list[list[int]], new_tokens: int, scope: str) -> dict:
    """The sessions one at a time against a fresh default `cloud serve` with prefix_scope `scope`."""
    metrics = free_port()
    ttft, tokens = [], []
    with cloud({"prefix_scope": scope, "metrics_port": metrics}) as (_, address):
        with VerifierClient(address) as client:
            for prompt in prompts:
                start = time.perf_counter()
                stream = client.generate(GenerateSpec(prompt_ids=tuple(prompt), max_new_tokens=new_tokens))
                out = [next(stream)]
                ttft.append(round(time.perf_counter() - start, 3))
                out += list(stream)
                tokens.append(out)
        time.sleep(2.5)  # one metrics refresh of the front door
        seen = counters(metrics)
    rest = median(ttft[1:])
    return {"prefix_scope": scope, "ttft_s": ttft, "first_s": ttft[0], "median_rest_s": rest,
            "first_over_median_rest": round(ttft[0] / rest, 2), "counters": seen, "tokens": tokens}


DECODED = 16


def prefill(engine: LlamaCppEngine, kv, tokens: list[int]) -> None:
    for start in range(0, len(tokens), 512):
        engine.reserve(kv, len(tokens[start:start + 512]))
        engine.forward([Feed(kv, tokens[start:start + 512], scored=False)])


def decode(engine: LlamaCppEngine, kv, last: int) -> tuple[list[int], torch.Tensor]:
    """16 greedy tokens after `kv`'s cache and `last`, then cut back; and the first token's logits."""
    length, out, first = kv.length, [], None
    for _ in range(DECODED):
        engine.reserve(kv, 1)
        logits = engine.forward([Feed(kv, [out[-1] if out else last], scored=True)])[0].logits[-1]
        first = logits if first is None else first
        out.append(int(np.argmax(logits.numpy())))
    engine.truncate(kv, length)
    return out, first


def long(args) -> dict:
    """Every strategy on each conversation length, against cloud-only's tokens."""
    paths = default_paths()
    rows = []
    with cloud() as (_, address):
        drafter = load_model(paths["drafter"], device="cpu")
        for length in args.lengths:
            prompt = long_conversation(drafter.tokenizer, length, "Thank you. Which of these should I read first?")
            runs = {name: generate(drafter, address, prompt, args.new_tokens, settings)
                    for name, settings in STRATEGIES.items()}
            reference = runs["cloud-only"]["tokens"]
            rows.append({"prompt_tokens": len(prompt), "strategies": {
                name: {**{k: v for k, v in r.items() if k != "tokens"}, "new_tokens": len(r["tokens"]),
                       "same_tokens_as_cloud_only": r["tokens"] == reference} for name, r in runs.items()}})
            print(json.dumps(rows[-1]), flush=True)
    return {**header(weights=served_weights(paths["target"])),
            "pool": "cloud serve defaults (Ray, one replica, llama.cpp, 1 thread, max_context 4096) on core 1",
            "new_tokens": args.new_tokens, "lengths": rows}


def prefix(args) -> dict:
    """The sessions with the prefix cache on and off: first-token times, counters, same tokens."""
    from transformers import AutoTokenizer

    target = default_paths()["target"]
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    prompts = [chat(tokenizer, q) for q in FREEFORM_PROMPTS[:args.sessions]]
    on, off = prefix_run(prompts, args.new_tokens, "identity"), prefix_run(prompts, args.new_tokens, "off")
    same = sum(a == b for a, b in zip(on.pop("tokens"), off.pop("tokens")))
    return {**header(weights=served_weights(target)),
            "pool": "cloud serve defaults (Ray, one replica, llama.cpp, 1 thread) on core 1",
            "prompt_tokens": [len(p) for p in prompts], "new_tokens": args.new_tokens,
            "shared_prefix_tokens": min(next((i for i, (x, y) in enumerate(zip(p, prompts[0])) if x != y), len(p))
                                        for p in prompts[1:]),
            "cache_on": on, "cache_off": off, "same_tokens_on_and_off": f"{same} of {len(prompts)}"}


def swap(args) -> dict:
    """Park and restore times per conversation length, and whether the restored session decodes the same."""
    target = default_paths()["target"]
    gguf = find_gguf(target)
    engine = LlamaCppEngine.serving(gguf, VerifierLimits(max_context=4096, kv_streams=1, max_sessions=2,
                                                         kv_cache_tokens=8192, max_tree_nodes=0), 1)
    tokenizer = GgufTarget(str(target), gguf, engine.vocab_size).tokenizer
    rows = []
    for length in args.lengths:
        conversation = long_conversation(tokenizer, length, "Thank you. What should I read next?")
        session, other = engine.new_sequence(), engine.new_sequence()
        prefill(engine, session, conversation[:-1])
        reference, logits = decode(engine, session, conversation[-1])
        park_ms, restore_ms, same, state_bytes = [], [], [], 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            engine.reserve(other, 1)  # takes the only stream: `session` is parked
            park_ms.append((time.perf_counter() - start) * 1e3)
            assert session.seq_id is None and engine.parked_tokens == session.length
            state_bytes = len(session.parked)
            engine.forward([Feed(other, [conversation[0]], scored=False)])
            start = time.perf_counter()
            engine.reserve(session, 1)  # back into the stream: `other` (1 token) is parked, `session` restored
            restore_ms.append((time.perf_counter() - start) * 1e3)
            engine.truncate(session, session.length)
            tokens, first = decode(engine, session, conversation[-1])
            same.append(tokens == reference and torch.equal(first, logits))
            engine.release(other)
        row = {"tokens": session.length, "state_mb": round(state_bytes / 2**20, 1),
               "bytes_per_token": round(state_bytes / session.length),
               "park_ms": round(median(park_ms), 2), "restore_ms": round(median(restore_ms), 2),
               "park_ms_all": [round(x, 2) for x in park_ms], "restore_ms_all": [round(x, 2) for x in restore_ms],
               "identical_after_restore": f"{sum(same)} of {len(same)}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        engine.release(session)
    return {**header(weights=served_weights(target)),
            "engine": "llamacpp, 1 thread, a stream of 4,096 cells", "decoded_tokens": DECODED, "sessions": rows}


def main() -> None:
    parser = arguments(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    long_ = commands.add_parser("long", help="conversations of thousands of tokens through the default pool")
    long_.add_argument("--lengths", type=int, nargs="+", default=[2300, 3500])
    long_.add_argument("--new-tokens", type=int, default=48)
    shared = commands.add_parser("prefix", help="sessions sharing the system prompt, prefix cache on and off")
    shared.add_argument("--sessions", type=int, default=9)
    shared.add_argument("--new-tokens", type=int, default=16)
    parked = commands.add_parser("swap", help="parking a session in host memory and restoring it")
    parked.add_argument("--lengths", type=int, nargs="+", default=[200, 1000, 4090])
    parked.add_argument("--repeats", type=int, default=5)
    for command in (long_, shared, parked):
        command.add_argument("--out", default="")
    args = parser.parse_args()
    report({"long": long, "prefix": prefix, "swap": swap}[args.command](args), args.out)


if __name__ == "__main__":
    main()
