"""`hybridspec edge generate`: draft locally, verify in the cloud, print (or stream) the result."""
from __future__ import annotations

import json
import os
import sys

from rich.console import Console
from rich.live import Live
from rich.text import Text

from . import serve_cmd
from .edge_options import add_edge_options, build_worker, edge_config


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
    serve_cmd.register(esub)


def prompt_ids(codec, text: str, chat: bool) -> list[int]:
    """The prompt's token ids: `text` alone, or as one user message in the chat template."""
    if chat and not codec.chat_template:
        raise ValueError("--chat needs a tokenizer with a chat template; this one has none")
    ids = codec.encode_chat([{"role": "user", "content": text}]) if chat else codec.encode(text)
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    return ids


def run_generate(args) -> int:
    """Generate and print text, JSON, or a live stream. While the cloud caches a long prompt, a line on
    stderr says how far it got (each report, at least every 2 s). If the cloud is lost mid-way without
    --allow-unverified, what was committed is still printed, then the error (exit 2); a failure before
    the first token is the error line alone."""
    from ..common.protocol.errors import HybridSpecError
    from ..edge.generation import EventKind

    config = edge_config(args)
    worker = build_worker(config, background=True)
    error = None
    try:
        gen = worker.stream(prompt_ids(worker.codec, args.prompt, args.chat))
        try:
            if args.stream:
                stream_to_terminal(gen, worker.codec, args.show_draft)
            else:
                for event in gen:
                    if event.kind is EventKind.PROGRESS:
                        print(f"({event.message})", file=sys.stderr, flush=True)
        except HybridSpecError as exc:
            error = exc
    finally:
        worker.close()
    # A failure before any token leaves nothing to show but the error: one line, as for any other error.
    anything = error is None or bool(gen.token_ids)
    if args.json:
        print(json.dumps({"text": gen.text, "token_ids": gen.token_ids,
                          "finish_reason": gen.finish_reason if error is None else "error",
                          "error": gen.error, "stats": gen.stats.to_dict()}))
    elif not args.stream and anything:
        print(gen.text)
    if anything:
        print(summary(gen.stats), file=sys.stderr)
    code = 0
    if error is not None:
        after = " (the text above is what was verified before it)" if gen.token_ids else ""
        print(f"hybridspec: error: {error}{after}", file=sys.stderr)
        code = 2
    if worker.load.pending():
        # The generation ended before the drafter finished loading. Exiting while its thread is inside
        # torch's import can abort the interpreter, and waiting for it is pointless: leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def summary(s) -> str:
    """The one-line stats after a generation, in words that fit what happened."""
    parts = [f"{s.new_tokens} tokens"]
    if s.rounds:
        parts[0] += f" in {s.rounds} rounds"
        parts += [f"acceptance {s.acceptance_rate:.2f}", f"{s.mean_tokens_per_round:.2f} tokens/round"]
    elif s.cloud_only_tokens == s.new_tokens and s.new_tokens:
        parts[0] += " decoded by the cloud alone (no draft was verified)"
    parts.append(f"{s.tokens_per_s:.1f} tokens/s")
    if s.rounds and s.cloud_only_tokens:
        parts.append(f"{s.cloud_only_tokens} decoded by the cloud alone")
    if s.unverified:
        parts.append(f"{s.unverified} unverified")
    return "[" + ", ".join(parts) + "]"


def stream_to_terminal(run, codec, show_draft: bool) -> None:
    """Print text as it becomes final. On a terminal with --show-draft, the block being verified
    (or text drafted while offline) is shown dimmed after it and replaced as verdicts come in; only
    the last screenful is redrawn, so a small terminal stays readable. Notices and the cloud's
    progress on a long prompt go to stderr."""
    from ..edge.generation import EventKind

    console = Console(stderr=False)
    if show_draft and console.is_terminal:
        text = ""
        with Live(Text(), console=console, refresh_per_second=20, vertical_overflow="visible",
                  transient=False) as live:
            for event in run:
                text += event.text
                if event.kind in (EventKind.NOTICE, EventKind.PROGRESS):
                    print(f"({event.message})", file=sys.stderr)
                view = Text(_tail(text, console.size))
                if event.provisional:
                    view.append(codec.decode(list(event.provisional)), style="dim")
                live.update(view)
        return
    for event in run:  # append-only: the terminal scrolls as usual
        if event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif event.kind in (EventKind.NOTICE, EventKind.PROGRESS):
            line = f"\n({event.message})" if console.is_terminal else f"({event.message})"
            print(line, file=sys.stderr, flush=True)
    sys.stdout.write("\n")


def _tail(text: str, size) -> str:
    """The end of `text` that fits a terminal of `size`, wrapped lines counted (a live view taller
    than the screen cannot be redrawn and garbles the scrollback)."""
    rows, kept = max(1, size.height - 2), []
    for line in reversed(text.split("\n")):
        rows -= max(1, -(-len(line) // max(1, size.width)))
        if rows < 0 and kept:
            break
        kept.append(line)
    return "\n".join(reversed(kept))


STYLE = {"accepted": "green", "corrected": "bold yellow", "bonus": "cyan", "cloud": "magenta", "unverified": "dim"}


def render_origins(codec, token_ids, origins) -> Text:
    """The generated text with each token coloured by where it came from."""
    text = Text()
    for token, origin in zip(token_ids, origins):
        text.append(codec.decode([token]), style=STYLE[origin.value])
    return text


def legend() -> Text:
    """One line explaining the colours."""
    return Text.assemble(("drafted on the edge and accepted", STYLE["accepted"]), "  ",
                         ("corrected by the cloud", STYLE["corrected"]), "  ",
                         ("bonus token from the cloud", STYLE["bonus"]), "  ",
                         ("decoded by the cloud alone", STYLE["cloud"]), "  ",
                         ("unverified", STYLE["unverified"]))
