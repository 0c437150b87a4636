"""Entry point of the `hybridspec` console script."""
from __future__ import annotations

import argparse
import os
import sys
import traceback

# Offline before transformers is imported anywhere: nothing may reach a model hub at run time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Quiet without importing transformers here: an edge's first tokens must not wait for that import.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# Read by grpcio when it is imported. No hybridspec process uses gRPC in a forked child (Ray's
# processes are exec'd afresh), so gRPC's fork handlers are off: with them on, every fork Ray makes
# while gRPC threads run logs "fork_posix.cc ... skipping fork() handlers".
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# gRPC's C core logs a refused TLS handshake at INFO on stderr, beside the CLI's own one-line error
# that already names the cause. Errors (a server's view of a bad client handshake) still print.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line naming the problem, not the whole usage first
    (`cloud serve` has some forty flags)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The full command tree."""
    from . import (cloud_cmd, demo_cmd, distill_cmd, edge_cmd, experiment_cmd, models_cmd, netem_cmd, pair_cmd,
                   token_cmd)

    parser = OneLineParser(prog="hybridspec", description="Edge-cloud speculative decoding.")
    parser.add_argument("--version", action="version", version=f"hybridspec {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    models_cmd.register(sub)
    cloud_cmd.register(sub)
    edge_cmd.register(sub)
    pair_cmd.register(sub)
    demo_cmd.register(sub)
    distill_cmd.register(sub)
    netem_cmd.register(sub)
    experiment_cmd.register(sub)
    token_cmd.register(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hybridspec")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """Parse, run, and turn every failure into one line on stderr and a non-zero exit."""
    args = build_parser().parse_args(argv)
    from ..common.config import ConfigError
    from ..common.protocol.errors import HybridSpecError

    try:
        return int(args.run(args) or 0)
    except (HybridSpecError, ConfigError, FileNotFoundError, OSError) as exc:
        print(f"hybridspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hybridspec: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: still one line unless the user asks for the traceback
        if os.environ.get("HYBRIDSPEC_DEBUG"):
            traceback.print_exc()
        print(f"hybridspec: internal error: {type(exc).__name__}: {exc} (HYBRIDSPEC_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
