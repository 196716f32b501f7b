"""The `eplb` command line. Each subcommand lives in its own module with a `register(subparsers)`."""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
import typing
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from eplb.errors import SECRET_REFUSED, SETTING_REFUSED, EplbError, one_line
from eplb.errors import clip as clip  # the commands echo values through these (eplb.errors)
from eplb.errors import shown as shown

if TYPE_CHECKING:  # pydantic is imported by the commands that read settings, not at every start-up
    from pydantic import BaseModel, ValidationError

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
    `--gpus-per-node 32` where a command has no --gpus), and arguments a parser does not know are its own error,
    with its usage and the nearest flag (`eplb solve: error: unrecognized arguments: --gpu 32 (did you mean
    --gpus?)`): argparse leaves a subcommand's to the top-level parser, whose usage (`eplb [-h] COMMAND ...`) says
    nothing of the command. Subparsers, and theirs, are made of the class of the parser that adds them, so setting
    it here covers every command."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]  # argparse's stub overloads it
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """argparse's, refusing what is left over (a subparser's parse is this call too): nothing is returned in
        the list."""
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._nearest(extras)}")
        return parsed, extras

    def _nearest(self, extras: Sequence[str]) -> str:
        """' (did you mean --gpus?)' for the flags among `extras` close to one of this parser's (`nearest_flag`)."""
        known = [flag for action in self._actions for flag in action.option_strings
                 if flag.startswith("--") and flag != "--help"]  # `--ep 8` meant no --help
        pairs = [(word, near) for word in (e.split("=", 1)[0] for e in extras if e.startswith("--"))
                 if (near := nearest_flag(word, known)) is not None]
        if not pairs:
            return ""
        if len(pairs) == 1:
            return f" (did you mean {pairs[0][1]}?)"
        return f" (did you mean {', '.join(f'{near} for {word}' for word, near in pairs)}?)"


SYNONYMS = {"--ep": "--gpus", "--gpus": "--ep"}
"""Flags that name one thing in different commands: the EP size is `eplb compare`'s and `eplb cost`'s --ep (a list
of sizes), the other commands' --gpus."""


def nearest_flag(word: str, known: Sequence[str]) -> str | None:
    """The flag of `known` that `word` (a long option a parser does not take) most likely meant, or None: the
    shortest flag `word` begins (`--slots` -> `--slots-per-gpu`, `--gpu` -> `--gpus`), else the longest flag that
    begins `word` (`--gpus-per-nodes` -> `--gpus-per-node`), else the closest by spelling (difflib, on the names
    without their dashes: `--redundent` -> `--redundant`; the shared '--' made `--slots` look like `--split` and
    `--ep` like `--help`); first of all a command's name for what another command calls `word` (`SYNONYMS`)."""
    same = SYNONYMS.get(word)
    if same in known:
        return same
    if len(word) > 3:  # '--x': more than the dashes
        starting = [flag for flag in known if flag.startswith(word)]
        if starting:
            return min(starting, key=len)
        begun = [flag for flag in known if word.startswith(flag)]
        if begun:
            return max(begun, key=len)
    names = {flag[2:]: flag for flag in known}
    near = difflib.get_close_matches(word[2:], list(names), n=1, cutoff=0.6)
    return names[near[0]] if near else None


_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
_BOUND_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal", "int_from_float"})
"""pydantic's errors that the accepted type and bounds say all of (others add pydantic's message)."""
_KINDS = {int: "a whole number", float: "a number", str: "text", bool: "true or false"}


def settings_error(exc: ValidationError, model: type[BaseModel], flags: Mapping[str, str] | None = None) -> EplbError:
    """One line for settings pydantic-settings refused: for each bad field, where its value came from (the flag
    `flags` maps the field to, else the environment variable EPLB_<FIELD> as it is spelled there), the value,
    and what the field accepts (its type, bounds and description), e.g. `EPLB_QUEUE_LIMIT='abc': give a whole
    number >= 0 (solves that may wait for a worker before 503)`."""
    parts = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        info = model.model_fields.get(field)
        if info is None:
            parts.append(f"bad setting{' ' + field if field else ''}: {err['msg']}")
            continue
        flag = (flags or {}).get(field)
        env = next((k for k in os.environ if k.upper() == f"EPLB_{field.upper()}"), f"EPLB_{field.upper()}")
        if err["type"] == SECRET_REFUSED:  # a secret: where it came from, never its value
            parts.append(f"{flag or env}: {err['msg']}")
            continue
        source = f"{flag} {shown(err['input'])}" if flag is not None else f"{env}={shown(err['input'])}"
        if err["type"] == SETTING_REFUSED:  # our validator's message says what is accepted
            parts.append(f"{source}: {err['msg']}")
            continue
        kinds = [t for t in (typing.get_args(info.annotation) or (info.annotation,)) if t is not type(None)]
        kind = " or ".join(_KINDS.get(t, getattr(t, "__name__", str(t))) for t in kinds)
        bounds = [f"{sign} {getattr(m, attr):g}" for m in info.metadata for attr, sign in _BOUNDS if hasattr(m, attr)]
        accepted = " and ".join([f"{kind} {bounds[0]}" if bounds else kind, *bounds[1:]])
        about = f" ({info.description})" if info.description else ""
        said = "" if err["type"].endswith("_parsing") or err["type"] in _BOUND_ERRORS else f"{err['msg']}; "
        parts.append(f"{source}: {said}give {accepted}{about}")
    return EplbError("; ".join(parts))


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


PATH_METAVARS = frozenset({"FILE", "DIR", "NAME|FILE", "NAME|FILE.json"})
"""The metavars of the options that take a file or directory name (a preset's name, for NAME|FILE)."""


def command_parsers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[argparse.ArgumentParser]:
    """The parsers of the run's command, outermost first: eplb's, the command's, an action's (`eplb logs
    convert`, `eplb deployments put`)."""
    parsers = [parser]
    for p in parsers:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(args, action.dest, None) or "")
                parsers.extend([chosen] if chosen is not None else [])
    return parsers


def refuse_empty_names(parsers: Sequence[argparse.ArgumentParser], args: argparse.Namespace) -> None:
    """EplbError for a file option given an empty name (an unset `$VAR`), `eplb.io.files.usable_path`'s words: the
    commands test most of them for truth, and took '' as not given (`replay --out ""` wrote nothing, `compare --log
    ""` compared the embedded window, `solve --current ""` solved afresh). parsers: `command_parsers`."""
    from eplb.io.files import usable_path

    for p in parsers:
        for action in p._actions:
            if (action.metavar in PATH_METAVARS and action.option_strings
                    and getattr(args, action.dest, None) == ""):
                usable_path("", action.option_strings[0])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    parsers = command_parsers(parser, args)
    try:
        refuse_empty_names(parsers, args)
        code: int = args.func(args)
    except EplbError as exc:
        print(f"{parsers[-1].prog}: error: {one_line(str(exc))}", file=sys.stderr)  # as argparse's: eplb logs convert
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
