"""`hybridspec token`: issue and revoke the per-edge tokens a credentials file holds (common/security/credentials.py).
The same file serves `cloud serve --credentials` (gRPC) and `edge serve --api-keys` (HTTP)."""
from __future__ import annotations

import sys


def register(sub) -> None:
    """Add the `token` command group."""
    token = sub.add_parser("token", help="issue and revoke edge tokens in a credentials file")
    tsub = token.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    add = tsub.add_parser("add", help="issue a token for an identity (replacing its old one); prints it once")
    add.add_argument("name", help="the identity: 1-64 letters, digits, '.', '_', '@' or '-'")
    add.add_argument("--file", required=True, help="the credentials file (created if missing, mode 0600)")
    add.add_argument("--max-sessions", type=int, help="sessions this identity may hold (default: the server's)")
    add.add_argument("--tokens-per-s", type=float, help="target tokens per second for it (default: the server's)")
    add.add_argument("--weight", type=float, help="its share of each replica's passes and KV cells against the "
                                                  "other identities with work there (default 1)")
    add.add_argument("--token-out", help="write the token to this file (mode 0600) instead of printing it")
    add.set_defaults(run=run_add)
    remove = tsub.add_parser("remove", help="revoke an identity's token (servers notice within a second)")
    remove.add_argument("name")
    remove.add_argument("--file", required=True)
    remove.set_defaults(run=run_remove)
    listing = tsub.add_parser("list", help="the identities in a credentials file and their limits")
    listing.add_argument("--file", required=True)
    listing.set_defaults(run=run_list)


def run_add(args) -> int:
    """Issue the token; it is shown once and only its digest is kept."""
    import os

    from ..common.security.credentials import add_identity

    token = add_identity(args.file, args.name, args.max_sessions, args.tokens_per_s, args.weight)
    if args.token_out:
        fd = os.open(args.token_out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        print(f"token for {args.name} written to {args.token_out}", file=sys.stderr)
    else:
        print(token)
        print(f"(the token for {args.name}; {args.file} keeps only its digest, so store it now)", file=sys.stderr)
    return 0


def run_remove(args) -> int:
    """Revoke; exit 1 if the identity was not there."""
    from ..common.security.credentials import remove_identity

    if not remove_identity(args.file, args.name):
        print(f"hybridspec: error: {args.file} has no identity {args.name!r}", file=sys.stderr)
        return 1
    return 0


def run_list(args) -> int:
    """One line per identity."""
    from ..common.security.credentials import DEFAULT_WEIGHT, list_identities

    for identity in list_identities(args.file):
        limits = [f"max_sessions={identity.max_sessions}" if identity.max_sessions is not None else "",
                  f"tokens_per_s={identity.tokens_per_s:g}" if identity.tokens_per_s is not None else "",
                  f"weight={identity.weight:g}" if identity.weight != DEFAULT_WEIGHT else ""]
        print(" ".join([identity.name, *filter(None, limits)]))
    return 0
