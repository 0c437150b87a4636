"""`hybridspec edge generate`: draft locally, verify in the cloud, print the result."""
from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.text import Text


def register(sub) -> None:
    """Add the `edge` command group."""
    edge = sub.add_parser("edge", help="run an edge worker")
    esub = edge.add_subparsers(dest="edge_command", required=True, metavar="ACTION")
    gen = esub.add_parser("generate", help="generate text with cloud verification")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as one user message (chat template)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    add_edge_options(gen)
    gen.set_defaults(run=run_generate)


def add_edge_options(parser) -> None:
    """Flags that override EdgeConfig keys (shared with `demo`)."""
    parser.add_argument("--config", help="YAML file of EdgeConfig keys")
    parser.add_argument("--cloud", help="HOST:PORT of the verifier (default 127.0.0.1:50051)")
    parser.add_argument("--drafter", help="drafter model directory, .gguf file or cached hub id")
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
    parser.add_argument("--fallback-threshold", type=float,
                        help="BiLD alpha_FB: end a block after a token drafted with confidence below this (default 0.6)")
    parser.add_argument("--rollback-threshold", type=float, help="BiLD alpha_RB in nats (mode bild)")
    parser.add_argument("--lenience", type=float, help="lenience in (0, 1] (mode lenient)")
    parser.add_argument("--wire-top-k", type=int, help="support size of q sent per draft token (0 = full)")


def edge_config(args, **defaults):
    """EdgeConfig from defaults, --config and flags."""
    from ..common.config import load_config
    from ..edge.config import EdgeConfig

    keys = ["cloud", "drafter", "device", "torch_threads", "max_new_tokens", "temperature", "top_p", "top_k",
            "seed", "mode", "max_draft", "fallback_threshold", "rollback_threshold", "lenience", "wire_top_k"]
    overrides = {**defaults, **{k: getattr(args, k) for k in keys if getattr(args, k) is not None}}
    return load_config(EdgeConfig, args.config, overrides)


def build_worker(config):
    """Load the drafter, connect, and check the pair matches."""
    import torch

    from ..common.models import load_model
    from ..edge.client import VerifierClient
    from ..edge.worker import EdgeWorker
    from .models_cmd import resolve

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    drafter = load_model(resolve(config.drafter, "drafter"), config.device, config.dtype)
    client = VerifierClient(config.cloud, config.timeout_s)
    return EdgeWorker(drafter, client, config)


def run_generate(args) -> int:
    """Generate and print text (or JSON)."""
    from ..edge.prompt import encode_prompt

    config = edge_config(args)
    worker = build_worker(config)
    try:
        prompt_ids = encode_prompt(worker.drafter_model.tokenizer, args.prompt, args.chat)
        gen = worker.generate(prompt_ids)
    finally:
        worker.client.close()
    if args.json:
        print(json.dumps({"text": gen.text, "token_ids": gen.token_ids, "stats": gen.stats.to_dict()}))
        return 0
    print(gen.text)
    s = gen.stats
    print(f"[{s.new_tokens} tokens in {s.rounds} rounds, acceptance {s.acceptance_rate:.2f}, "
          f"{s.mean_tokens_per_round:.2f} tokens/round, {s.tokens_per_s:.1f} tokens/s]", file=sys.stderr)
    return 0


STYLE = {"accepted": "green", "corrected": "bold yellow", "bonus": "cyan"}


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
                         ("bonus token from the cloud", STYLE["bonus"]))
