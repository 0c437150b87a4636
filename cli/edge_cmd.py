"""`hybridspec edge generate`: draft locally, verify in the cloud, print (or stream) the result."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from rich.console import Console
from rich.live import Live
from rich.text import Text


def register(sub) -> None:
    """Add the `edge` command group."""
    edge = sub.add_parser("edge", help="run an edge worker")
    esub = edge.add_subparsers(dest="edge_command", required=True, metavar="ACTION")
    gen = esub.add_parser("generate", help="generate text with cloud verification")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as one user message (chat template)")
    out = gen.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    out.add_argument("--stream", action="store_true", help="print text as it is verified")
    gen.add_argument("--show-draft", action="store_true",
                     help="with --stream: also show the block being verified and unverified text, dimmed")
    add_edge_options(gen)
    gen.set_defaults(run=run_generate)


def add_edge_options(parser) -> None:
    """Flags that override EdgeConfig keys (shared with `demo`)."""
    parser.add_argument("--config", help="YAML file of EdgeConfig keys")
    parser.add_argument("--cloud", help="HOST:PORT of the verifier (default 127.0.0.1:50051)")
    parser.add_argument("--drafter", help="drafter model directory, .gguf file, cached hub id, embedded:plain or embedded:eagle")
    parser.add_argument("--drafter-kind", choices=["model", "ngram"], help="model (default) or ngram (prompt lookup)")
    parser.add_argument("--features", choices=["int8", "fp16"],
                        help="eagle drafters: how the verifier sends the target's features (default int8)")
    parser.add_argument("--fallback-drafter",
                        help='eagle drafters: what drafts while there are no features: a drafter path, "ngram", '
                             'or (default) the embedded plain drafter')
    parser.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--torch-threads", type=int, help="CPU intra-op threads (0 = torch default)")
    parser.add_argument("--max-new-tokens", type=int, help="tokens to generate at most (default 128)")
    parser.add_argument("--temperature", type=float, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, help="nucleus truncation, applied on both sides")
    parser.add_argument("--top-k", type=int, help="top-k truncation, applied on both sides")
    parser.add_argument("--seed", type=int, help="seeds drafter and verifier randomness")
    parser.add_argument("--mode", choices=["greedy", "speculative", "bild", "lenient"],
                        help="acceptance rule (default: greedy at T=0, else speculative)")
    parser.add_argument("--max-draft", type=int, help="most tokens drafted per round (default 8)")
    parser.add_argument("--gamma-policy", choices=["adaptive", "fixed"],
                        help="adaptive (default): γ per round from measured acceptance, RTT and costs; fixed: --max-draft")
    parser.add_argument("--fallback-threshold", type=float,
                        help="BiLD alpha_FB: end a block when the drafter's confidence drops below this (default 0.6)")
    parser.add_argument("--keep-low-confidence", action=argparse.BooleanOptionalAction,
                        help="send the token that triggered alpha_FB (default) or drop it (BiLD)")
    parser.add_argument("--rollback-threshold", type=float, help="BiLD alpha_RB in nats (mode bild)")
    parser.add_argument("--lenience", type=float, help="lenience in (0, 1] (mode lenient)")
    parser.add_argument("--wire-top-k", type=int, help="support size of q sent per draft token (0 = full)")
    parser.add_argument("--pipeline", action=argparse.BooleanOptionalAction,
                        help="draft the next block while the current one is verified (default on)")
    parser.add_argument("--cloud-only-switch", action=argparse.BooleanOptionalAction,
                        help="let the cloud decode alone while that is predicted faster (default on)")
    parser.add_argument("--cloud-only", action="store_true", default=None,
                        help="the baseline: the cloud decodes every token alone (same CLI path, no drafting)")
    parser.add_argument("--allow-unverified", action=argparse.BooleanOptionalAction,
                        help="if the cloud is unreachable, keep generating with the drafter, marked unverified")
    parser.add_argument("--timeout-s", type=float, help="no reply within this long = cloud unreachable (default 30)")


def edge_config(args, **defaults):
    """EdgeConfig from defaults, --config and flags."""
    from ..common.config import load_config
    from ..edge.config import EdgeConfig

    keys = [f.name for f in dataclasses.fields(EdgeConfig) if hasattr(args, f.name)]
    overrides = {**defaults, **{k: getattr(args, k) for k in keys if getattr(args, k) is not None}}
    return load_config(EdgeConfig, args.config, overrides)


def build_worker(config):
    """Load the drafter, connect, and check the pair matches."""
    import torch

    from ..common.models import load_model
    from ..edge.client import VerifierClient
    from ..edge.worker import EdgeWorker
    from ..common.embedded import resolve

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    drafter = load_model(resolve(config.drafter, "drafter"), config.device, config.dtype)
    fallback = None
    if drafter.is_eagle and config.fallback_drafter != "ngram":
        fallback = load_model(resolve(config.fallback_drafter, "plain"), config.device, config.dtype)
    client = VerifierClient(config.cloud, config.timeout_s)
    try:
        return EdgeWorker(drafter, client, config, fallback)
    except BaseException:
        client.close()
        raise


def run_generate(args) -> int:
    """Generate and print text, JSON, or a live stream."""
    from ..edge.prompt import encode_prompt

    config = edge_config(args)
    worker = build_worker(config)
    try:
        prompt_ids = encode_prompt(worker.drafter_model.tokenizer, args.prompt, args.chat)
        run = worker.stream(prompt_ids)
        if args.stream:
            stream_to_terminal(run, worker.drafter_model.tokenizer, args.show_draft)
        else:
            for _ in run:
                pass
        gen = run.generation
    finally:
        worker.client.close()
    if args.json:
        print(json.dumps({"text": gen.text, "token_ids": gen.token_ids, "stats": gen.stats.to_dict()}))
        return 0
    if not args.stream:
        print(gen.text)
    s = gen.stats
    if s.rounds:
        print(f"[{s.new_tokens} tokens in {s.rounds} rounds, acceptance {s.acceptance_rate:.2f}, "
              f"{s.mean_tokens_per_round:.2f} tokens/round, {s.tokens_per_s:.1f} tokens/s"
              f"{f', {s.cloud_only_tokens} decoded by the cloud alone' if s.cloud_only_tokens else ''}"
              f"{f', {s.unverified} unverified' if s.unverified else ''}]", file=sys.stderr)
    else:
        print(f"[{s.new_tokens} tokens decoded by the cloud alone, {s.tokens_per_s:.1f} tokens/s]", file=sys.stderr)
    return 0


def stream_to_terminal(run, tokenizer, show_draft: bool) -> None:
    """Print committed text as it is verified; on a terminal, with --show-draft, also the provisional
    text (the block in flight, or tokens drafted while offline) dimmed, replaced as verdicts come in."""
    from ..edge.state import EventKind

    console = Console(stderr=False)
    committed: list[int] = []
    printed = 0  # characters of committed text already written (plain output)

    def view(provisional) -> Text:
        text = Text(tokenizer.decode(committed, skip_special_tokens=True))
        if show_draft and provisional:
            text.append(tokenizer.decode(list(provisional), skip_special_tokens=True), style="dim")
        return text

    if console.is_terminal:
        with Live(view(()), console=console, refresh_per_second=20, transient=False) as live:
            for event in run:
                if event.kind is EventKind.COMMIT:
                    committed.extend(event.tokens)
                elif event.kind is EventKind.NOTICE:
                    live.console.print(f"[italic]({event.message})[/]", highlight=False)
                live.update(view(event.provisional))
        return
    for event in run:  # not a terminal: append-only text, notices on stderr
        if event.kind is EventKind.COMMIT:
            committed.extend(event.tokens)
            text = tokenizer.decode(committed, skip_special_tokens=True)
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
        elif event.kind is EventKind.NOTICE:
            print(f"({event.message})", file=sys.stderr)
    sys.stdout.write("\n")


STYLE = {"accepted": "green", "corrected": "bold yellow", "bonus": "cyan", "cloud": "magenta", "unverified": "dim"}


def render_origins(tokenizer, token_ids, origins) -> Text:
    """The generated text with each token coloured by where it came from."""
    text = Text()
    for token, origin in zip(token_ids, origins):
        text.append(tokenizer.decode([token], skip_special_tokens=True), style=STYLE[origin.value])
    return text


def legend() -> Text:
    """One line explaining the colours."""
    return Text.assemble(("drafted on the edge and accepted", STYLE["accepted"]), "  ",
                         ("corrected by the cloud", STYLE["corrected"]), "  ",
                         ("bonus token from the cloud", STYLE["bonus"]), "  ",
                         ("decoded by the cloud alone", STYLE["cloud"]), "  ",
                         ("unverified", STYLE["unverified"]))
