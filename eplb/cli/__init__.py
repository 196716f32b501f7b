"""The `eplb` command line. Each subcommand lives in its own module with a `register(subparsers)`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from eplb.errors import EplbError


def build_parser() -> argparse.ArgumentParser:
    from eplb.cli import compare, cost, deployments, interop, logs, replay, serve, solve

    parser = argparse.ArgumentParser(
        prog="eplb",
        description="Expert placement for Mixture-of-Experts inference: replicate hot experts and pack "
        "them so every GPU carries about the same load.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    solve.register(sub)
    cost.register(sub)
    replay.register(sub)
    compare.register(sub)
    interop.register(sub)
    logs.register(sub)
    serve.register(sub)
    deployments.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code: int = args.func(args)
    except EplbError as exc:
        print(f"eplb {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("eplb: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
