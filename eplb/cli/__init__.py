"""The `eplb` command line. Each subcommand lives in its own module with a `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from eplb.errors import EplbError

MODULES = ("solve", "cost", "replay", "compare", "interop", "logs", "serve", "deployments")
"""The subcommand modules, in the order `eplb --help` lists their commands."""
COMMANDS = {
    "solve": "solve", "evaluate": "solve", "cost": "cost", "synth": "replay", "replay": "replay",
    "compare": "compare", "export": "interop", "import-load": "interop", "logs": "logs", "serve": "serve",
    "deployments": "deployments", "history": "deployments",
}  # fmt: skip
"""Which module registers each command: a run imports only its own (start-up stays short)."""


class Parser(argparse.ArgumentParser):
    """The CLI's parser class: no prefix matching of long options (`--gpus 32` must never be read as
    `--gpus-per-node 32` where a command has no --gpus). Subparsers, and theirs, are made of the class of the
    parser that adds them, so setting it here covers every command."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


def clip(text: str, width: int = 40) -> str:
    """`text` as it fits in `width` characters: cut, its last character an ellipsis, when longer (a name a message
    or a table cell echoes)."""
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def shown(value: object, width: int = 40) -> str:
    """`value` for a message: repr of a string (clipped to `width` characters, with its length when cut), else str."""
    if not isinstance(value, str):
        return str(value)
    return repr(value) if len(value) <= width else f"{clip(value, width)!r} ({len(value):,} characters)"


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`'s command (every command when argv names none, e.g. for --help)."""
    words = [w for w in (argv or []) if not w.startswith("-")]
    wanted = [COMMANDS[words[0]]] if words and words[0] in COMMANDS else list(MODULES)
    parser = Parser(
        prog="eplb",
        description="Expert placement for Mixture-of-Experts inference: replicate hot experts and pack "
        "them so every GPU carries about the same load.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in wanted:
        importlib.import_module(f"eplb.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    args.argv = argv
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
