"""What every command that runs an edge worker shares (`edge generate`, `edge serve`, `demo`): the
EdgeConfig flags, the config they make, and starting the worker."""
from __future__ import annotations

import argparse
import dataclasses

from ..common.protocol.channel import DEFAULT_CLOUD_ADDRESS


def add_edge_options(parser) -> None:
    """Flags that override EdgeConfig keys (shared with `demo`)."""
    parser.add_argument("--config", help="YAML file of EdgeConfig keys")
    parser.add_argument("--cloud", help=f"HOST:PORT of the verifier (default {DEFAULT_CLOUD_ADDRESS})")
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
    parser.add_argument("--seed", type=int,
                        help="the same text for the same seed when sampling (coupled rule); default: a fresh seed")
    parser.add_argument("--stop", action="append",
                        help="end the text before this string (repeatable); applied to verified text only")
    parser.add_argument("--repetition-penalty", type=float,
                        help="> 1 discourages tokens already in the context (both sides apply it; default 1 = off)")
    parser.add_argument("--frequency-penalty", type=float,
                        help="in [-2, 2]: OpenAI's penalty per earlier occurrence in the generated text")
    parser.add_argument("--presence-penalty", type=float,
                        help="in [-2, 2]: OpenAI's penalty for tokens already in the generated text")
    parser.add_argument("--mode", choices=["greedy", "speculative", "coupled", "bild", "lenient"],
                        help="acceptance rule (default: greedy at T=0; else coupled with --seed, speculative without)")
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
    parser.add_argument("--tls", action="store_true", default=None,
                        help="speak TLS to the cloud, trusting the system's CAs (implied by --tls-ca, --tls-cert)")
    parser.add_argument("--tls-ca", help="PEM CA bundle the cloud's certificate must chain to")
    parser.add_argument("--tls-cert", help="PEM client certificate, for a cloud that requires mutual TLS")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", help="the name the cloud's certificate carries, if not the host dialled")
    parser.add_argument("--token-file", help="file holding this edge's token (default: $HYBRIDSPEC_TOKEN)")
    parser.add_argument("--insecure", action="store_true", default=None,
                        help="allow sending the token in plaintext to a cloud that is not on loopback")


def edge_config(args, **defaults):
    """EdgeConfig from defaults, --config and flags."""
    from ..common.config import load_config
    from ..edge.config import EdgeConfig

    keys = [f.name for f in dataclasses.fields(EdgeConfig) if hasattr(args, f.name)]
    overrides = {**defaults, **{k: getattr(args, k) for k in keys if getattr(args, k) is not None}}
    if isinstance(overrides.get("stop"), list):
        overrides["stop"] = tuple(overrides["stop"])
    return load_config(EdgeConfig, args.config, overrides)


def build_worker(config, background: bool = False, require_cloud: bool = True):
    """Connect, load the drafter (on a background thread if `background`: generations start with the
    cloud decoding alone meanwhile), and check the pair matches."""
    from ..edge.client import VerifierClient
    from ..edge.startup import DrafterLoad, fast_codec
    from ..edge.worker import EdgeWorker

    codec = fast_codec(config) if background else None
    load = DrafterLoad.start(config, background=background and codec is not None)
    client = VerifierClient(config.cloud, config.timeout_s, config.cloud_access())
    try:
        return EdgeWorker(load, client, config, codec=codec, require_cloud=require_cloud)
    except BaseException:
        client.close()
        raise
