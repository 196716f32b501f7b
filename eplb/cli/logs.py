"""`eplb logs convert IN OUT`: a routing log from one format to another (npz, JSONL, Parquet shards)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from eplb.errors import EplbError
from eplb.io.files import output_file, plural, refuse_input, usable_path
from eplb.io.logs import LOG_SUFFIXES, log_format, open_log, write_counts, write_jsonl
from eplb.io.logs import refuse_compress as refuse_compress_option
from eplb.io.parquet import SHARD_STEPS, write_parquet

DESCRIPTION = """\
Convert a routing log between formats, streaming (memory: one chunk of steps). The output's type comes
from its name: .npz (per-step counts), .jsonl, or a directory of Parquet shards (a name ending in
.parquet, or any name with --to parquet). Step ids, layer ids, model and top-k are kept. Token-level
.npz logs (topk_ids) convert to per-step counts. Formats: docs/formats.md."""

EPILOG = """\
examples:
  eplb logs convert log.npz log.parquet                      one shard per 10,000 steps
  eplb logs convert log.jsonl log.parquet --shard-steps 2000
  eplb logs convert log.parquet log.npz
  eplb logs convert log.npz shards/ --to parquet"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `logs` subcommand (with `convert`)."""
    p = subparsers.add_parser("logs", help="routing-log tools: convert between npz, JSONL and Parquet",
                              description="Routing-log tools.")
    sub = p.add_subparsers(dest="logs_command", metavar="ACTION", required=True)
    c = sub.add_parser("convert", help="convert a routing log (npz, JSONL, Parquet)", description=DESCRIPTION,
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("src", metavar="IN", help=f"routing log: {LOG_HELP}")
    c.add_argument("dst", metavar="OUT", help="file or directory to write")
    c.add_argument("--to", choices=("npz", "jsonl", "parquet"), help="output format (default: from OUT's name)")
    c.add_argument("--shard-steps", type=int, metavar="N",
                   help=f"Parquet: steps per shard file (default {SHARD_STEPS:,}); refused for npz and JSONL")
    c.add_argument("--compress", action="store_true", help="npz: deflate the members (smaller, slower to read); "
                   "refused for JSONL and Parquet")
    c.set_defaults(func=run_convert)


WRITTEN = ("npz", "jsonl", "parquet")
"""The formats `eplb logs convert` writes (of `eplb.io.logs.LOG_SUFFIXES`' table: .npy is read only)."""


def output_format(dst: Path, to: str | None) -> str:
    """npz, jsonl or parquet: `to`, else from the name (`eplb.io.logs.log_format`)."""
    if to is not None:
        return to
    fmt = log_format(dst)
    if fmt not in WRITTEN:
        raise EplbError(f"{dst}: cannot tell the output format from '{dst.suffix.lower() or dst.name}': name it "
                        ".npz, .jsonl or .parquet, or give --to")  # fmt: skip
    return fmt


LOG_HELP = (".npz (per-step counts or token-level topk_ids), .npy, .jsonl, or Parquet: a directory of shards or one "
            ".parquet shard")
"""What every command that reads a routing log takes (`eplb.io.logs.open_log`), for its help."""

def refuse_compress(compress: bool, fmt: str, what: str) -> None:
    """`eplb.io.logs.refuse_compress` in the CLI's words: --compress given for output format `fmt` (npz, jsonl or
    parquet) is refused unless it is npz; what: the output as the message names it ('--out log.jsonl')."""
    refuse_compress_option(compress, fmt, what, option="--compress")


def run_convert(args: argparse.Namespace) -> int:
    src, dst = Path(args.src), usable_path(args.dst, "OUT")  # every writer's check, before the log is read
    fmt = output_format(dst, args.to)
    if fmt != "parquet" and log_format(dst) != fmt:  # it was written, then not read back (a directory: any name)
        raise EplbError(f"--to {fmt} writes {fmt.upper()}: OUT {dst} must end in {' or '.join(LOG_SUFFIXES[fmt])} (a "
                        "log's format is told from its name when it is read)")
    refuse_compress(args.compress, fmt, f"OUT {dst}")
    if args.shard_steps is not None and fmt != "parquet":  # it was ignored
        raise EplbError(f"--shard-steps sets the steps per shard file of a Parquet log; OUT {dst} is "
                        f"{'NPZ' if fmt == 'npz' else 'JSONL'}, one file: drop --shard-steps, or name it .parquet")
    shard_steps = SHARD_STEPS if args.shard_steps is None else args.shard_steps
    if shard_steps < 1:
        raise EplbError(f"--shard-steps must be >= 1 (steps per shard file), got {shard_steps}")
    if fmt == "parquet":  # a directory of shards, made as replay's --out DIR
        refuse_input(dst, "OUT", [("IN", src)])
    else:  # one file: in a directory that is there, as every writer's output
        output_file(dst, "OUT", inputs=[("IN", src)])
    log = open_log(src)
    info = log.info
    if info.num_steps == 0:
        raise EplbError(f"{src}: the log has no steps: nothing to convert")
    # the writers keep the step ids and store the counts as the narrowest type they fit (`count_dtype`)
    meta: dict[str, Any] = {"model": info.model, "top_k": info.top_k, "layer_ids": info.layer_ids}
    if fmt == "parquet":
        write_parquet(dst, log, shard_steps=shard_steps, **meta)
    elif fmt == "npz":
        write_counts(dst, log, compress=args.compress, **meta)
    else:
        write_jsonl(dst, log, **meta)
    out = open_log(dst).info
    shards = f" in {plural(len(list(dst.glob('part-*.parquet'))), 'shard')}" if dst.is_dir() else ""
    print(f"wrote {out.describe()}{shards}")
    return 0
