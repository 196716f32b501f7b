"""Checks the file readers and writers of eplb share: input and output paths, JSON text, numeric and integer
tables."""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
import sys
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from eplb.errors import EplbError, shown


def int_table(value: Any, what: str) -> NDArray[np.int64]:
    arr = numeric_array(value, what)
    if arr.ndim != 2:
        raise EplbError(f"{what} must be [layers][slots], got shape {list(arr.shape)}")
    if arr.size == 0:
        raise EplbError(f"{what} is empty")
    if not np.all(np.mod(arr, 1) == 0):
        raise EplbError(f"{what} must hold integer expert ids")
    return _exact_ints(arr, what, "an expert id")


def int_list(value: Any, what: str) -> list[int]:
    """`value` as a list of integers (ids); EplbError naming `what` otherwise (true/false are not integers here)."""
    if isinstance(value, bool) or (isinstance(value, list | tuple) and any(isinstance(v, bool) for v in value)) or (
            isinstance(value, np.ndarray) and value.dtype.kind == "b"):
        raise EplbError(f"{what} must be a list of integers, got {shown(value)}")
    arr = numeric_array(value, what)
    if arr.ndim != 1 or not np.all(np.mod(arr, 1) == 0):
        raise EplbError(f"{what} must be a list of integers")
    return [int(v) for v in _exact_ints(arr, what, "an id")]


def _exact_ints(arr: NDArray[np.float64], what: str, noun: str) -> NDArray[np.int64]:
    """Whole numbers read through float64 as int64: exact only within +-2**53, so a larger one is refused by
    name rather than wrapped (2**70 would become -2**63)."""
    big = np.flatnonzero(np.abs(arr) > 2**53)
    if big.size:
        index = "".join(f"[{int(i)}]" for i in np.unravel_index(int(big[0]), arr.shape))
        raise EplbError(f"{what}{index} is {number_text(arr.flat[big[0]])}: too large for {noun}")
    return arr.astype(np.int64)


def numeric_array(value: Any, what: str) -> NDArray[np.float64]:
    if isinstance(value, list):
        check_rectangular(value, what)
    return real_array(value, what, f"{what} must hold only numbers")


FLOAT_MAX = float(np.finfo(np.float64).max)
"""What `real_array` reads an integer beyond float range as (with its sign): larger than any limit a caller
checks, so the caller's range message names it (`number_text` shows it as "more than 1.8e+308")."""


def tensor_values(value: Any, what: str) -> Any:
    """`value` as numpy reads it: a tensor (anything with `detach`; torch is not imported here) of any device and
    layout as a numpy array of its values, in its dtype, or float64 for a float dtype numpy lacks (bfloat16,
    float8); anything else as given. EplbError naming `what` for a tensor on the meta device (no values)."""
    if not hasattr(value, "detach"):
        return value
    tensor = value.detach()
    if getattr(tensor, "is_meta", False):
        raise EplbError(f"{what} is a tensor on the meta device, which holds no values")
    tensor = tensor.cpu()
    if str(tensor.layout) != "torch.strided":  # sparse: .numpy() takes dense tensors only
        tensor = tensor.to_dense()
    try:
        return tensor.numpy()
    except TypeError:  # bfloat16, float8
        return tensor.double().numpy()


def real_array(value: Any, what: str, not_numbers: str) -> NDArray[np.float64]:
    """`value` (rectangular; a tensor: `tensor_values`) as float64; EplbError `not_numbers` when it holds anything
    but integers and floats (strings such as "1e3", None, nested objects), and by name for an array of bools or
    complex numbers (numpy would drop the imaginary part). A true/false among numbers reads as a number here: JSON
    text is checked for those when it is read (`read_json`, `refuse_bools`). Integers beyond int64 read as floats,
    those beyond float range as +-FLOAT_MAX: callers' range checks name them."""
    value = tensor_values(value, what)
    try:
        raw = value if isinstance(value, np.ndarray) else np.asarray(value)
    except (ValueError, TypeError):
        raise EplbError(not_numbers) from None
    if raw.dtype.kind in "bc":
        raise EplbError(f"{what} must hold real numbers (integers or floats), got dtype {raw.dtype}")
    if raw.dtype.kind == "O" and all(type(v) in (int, float, bool) for v in raw.ravel()):  # big ints among them
        return np.array([_as_float(v) for v in raw.ravel()], dtype=np.float64).reshape(raw.shape)
    if raw.dtype.kind not in "iuf":
        raise EplbError(not_numbers)
    return np.asarray(raw, dtype=np.float64)


def _as_float(v: float) -> float:
    try:
        return float(v)
    except OverflowError:  # an int beyond float range
        return FLOAT_MAX if v > 0 else -FLOAT_MAX


def number_text(v: float | np.number[Any]) -> str:
    """A value for a message: integers and whole floats below 1e16 without a fraction (`-2`), other floats as
    Python prints them (`1.5`, `1e+30`, `nan`), +-FLOAT_MAX (an integer beyond float range, `real_array`) as
    `more than 1.8e+308`."""
    if isinstance(v, int | np.integer):
        return str(int(v))
    x = float(v)
    if abs(x) == FLOAT_MAX:
        return "more than 1.8e+308" if x > 0 else "less than -1.8e+308"
    if x.is_integer() and abs(x) < 1e16:
        return str(int(x))
    return repr(x)


def plural(n: int | np.integer[Any], noun: str, many: str | None = None) -> str:
    """`n noun` for a message, the noun in the plural unless n is 1: `1 step`, `0 steps`, `4,000 steps` (thousands
    separated). many: an irregular plural (`plural(n, "entry", "entries")`)."""
    return f"{int(n):,} {noun if n == 1 else many or noun + 's'}"


def refuse_bools(data: Any, text: str | bytes | None, what: str) -> None:
    """EplbError naming the first true/false in a list that also holds numbers, in `data` parsed from JSON
    `text` (JSON's true is no number, yet numpy reads it as 1); flags (an object's value, a list of bools)
    are left alone. Only JSON text that spells true or false is walked, so numbers-only files pay one
    substring search; text None (YAML, whose bools have other spellings) is always walked."""
    if isinstance(text, bytes) and b"true" not in text and b"false" not in text:
        return
    if isinstance(text, str) and "true" not in text and "false" not in text:
        return
    try:
        where = _bool_among_numbers(data)
    except RecursionError:  # parsed, yet too deep to walk here
        raise EplbError(f"{what}nested too deeply (lists or objects inside each other about "
                        f"{sys.getrecursionlimit():,} levels deep)") from None
    if where is not None:
        path, value = where
        raise EplbError(f"{what}{path} is {str(value).lower()}: give a number, not true/false")


def _bool_among_numbers(data: Any, path: str = "") -> tuple[str, bool] | None:
    if isinstance(data, dict):
        for key, item in data.items():
            found = _bool_among_numbers(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(data, list):
        numbers = any(type(v) in (int, float) for v in data)
        for i, item in enumerate(data):
            if numbers and isinstance(item, bool):
                return f"{path}[{i}]", item
            found = _bool_among_numbers(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def check_rectangular(rows: list[Any], what: str) -> None:
    if not rows or not all(isinstance(r, list) for r in rows):
        return
    for i, r in enumerate(rows):
        if len(r) != len(rows[0]):
            raise EplbError(f"{what} is ragged: row 0 has {plural(len(rows[0]), 'entry', 'entries')}, row {i} has "
                            f"{len(r)}")
    for i, r in enumerate(rows):
        check_rectangular(r, f"{what}[{i}]")


_PLACEMENT_KEYS = ("phy2log", "physical_to_logical_map", "initial_global_assignments", "layer_list")
"""The keys by which `eplb.io.foreign` knows a placement file (eplb's, SGLang's, TensorRT-LLM's, vllm-ascend's)."""


def json_kind(data: Any) -> tuple[str, str] | None:
    """The kind of eplb file a JSON value is, by its keys, for a refusal that names it: ("placement", "a placement
    file (phy2log)"), ("window", "a load window (loads)"), ("sglang", "SGLang's expert distribution dump
    (logical_count)") or ("plan", "a migration plan (stages)"); None when the keys tell none of these."""
    if not isinstance(data, dict):
        return None
    for key in _PLACEMENT_KEYS:
        if key in data:
            return "placement", f"a placement file ({key})"
    if "loads" in data:
        return "window", "a load window (loads)"
    if "logical_count" in data:
        return "sglang", "SGLang's expert distribution dump (logical_count)"
    if "stages" in data and "num_copies" in data:
        return "plan", "a migration plan (stages)"
    return None


def read_json(p: Path) -> Any:
    """The JSON value of file p; EplbError when it is not JSON, or holds a true/false among numbers."""
    try:
        text = p.read_text()
        data = parse_json(text, str(p))
    except UnicodeDecodeError as exc:  # a binary file (an .npz, a .parquet) given where JSON text is read
        raise EplbError(f"{p}: not valid JSON: not UTF-8 text (byte {exc.start}); is it a binary file?") from None
    except json.JSONDecodeError as exc:
        raise EplbError(f"{p}: not valid JSON ({exc})") from None
    refuse_bools(data, text, f"{p}: ")
    return data


def parse_json(text: str | bytes, where: str) -> Any:
    """json.loads(text), refusing a key given twice in one object (Python's reader keeps the last silently) and
    with the two failures it raises beyond JSONDecodeError (which the caller words, as it is left to it) as one
    EplbError starting `where` (the file, its line): lists or objects nested deeper than the reader's recursion
    takes (a RecursionError), and an integer longer than Python converts (a ValueError,
    `sys.get_int_max_str_digits`). Every JSON reader of eplb parses through it (`read_json`: load windows, load
    statistics, placements, co-activation summaries; `eplb.io.foreign`'s engine placements, `eplb.io.logs`' JSONL
    lines, `eplb.specs`' spec files)."""
    try:
        return json.loads(text, object_pairs_hook=lambda pairs: _unique_keys(pairs, where))
    except RecursionError:
        raise EplbError(f"{where}: nested too deeply to read (lists or objects more than about "
                        f"{sys.getrecursionlimit():,} levels inside each other)") from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:
        if "digits" not in str(exc):
            raise
        raise EplbError(f"{where}: holds a number with more than {_int_digits():,} digits "
                        "(no count or id is that long)") from None


def _unique_keys(pairs: list[tuple[str, Any]], where: str) -> dict[str, Any]:
    """One JSON object, refusing a key given twice (`parse_json`)."""
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise EplbError(f"{where}: key {key!r} appears twice in one object (JSON readers keep only the last); "
                            "give each key once")
        seen.add(key)
    raise AssertionError("unreachable: fewer keys than pairs means one repeats")


def _int_digits() -> int:
    """The longest integer Python converts from text (4,300 by default; 0: no limit)."""
    return sys.get_int_max_str_digits() or 4300


def unreadable_npz(path: str | Path, exc: BaseException) -> str:
    """Why an .npz is unreadable, one message for every reader: a file cut short (zipfile finds no directory at its
    end, `zipfile.BadZipFile`) is said to be one, with what helps."""
    text = f"{path}: not a readable .npz archive ({exc or 'cut short'})"
    if isinstance(exc, zipfile.BadZipFile):
        text += "; a file cut short loses the archive's directory at its end: copy it again"
    return text


def existing_file(raw: str | Path, what: str = "file") -> Path:
    """The path of a readable, non-empty regular file; otherwise an EplbError that says which of those it is not
    (a directory, a device such as /dev/null, a pipe, nothing there, a name the system refuses)."""
    p = usable_path(raw, what)
    if p.is_dir():
        raise EplbError(f"{what} {p} is a directory; give a file")
    if not p.is_file():
        if not p.exists():
            raise EplbError(f"{what} not found: {p}" + (" (a broken symbolic link)" if p.is_symlink() else ""))
        raise EplbError(f"{what} {p} exists but is not a regular file ({_kind(p)}); give a file")
    if p.stat().st_size == 0:
        raise EplbError(f"{what} {p} is empty (0 bytes)")
    try:
        with p.open("rb"):
            pass
    except OSError as exc:  # no permission to read it (the mode, an ACL, a dropped capability)
        raise EplbError(f"{what} {p}: cannot read it ({exc.strerror or exc}); give a file this user can read") from None
    return p


def usable_path(raw: str | Path, what: str) -> Path:
    """Path(raw), or an EplbError naming `what` (a flag, or what the path is) for a path the system will not look
    up (a file name over 255 bytes, a directory it may not search): Path's exists, is_dir and is_file raise those
    as OSError tracebacks. Every reader and writer checks its path with it before it looks at the path
    (`existing_file`, `output_file`, `output_dir`, `eplb.io.logs.open_log` and `output_log`). Nothing there, or a
    file in the way of a directory, is left to the caller to say."""
    if str(raw) == "":  # Path("") is ".", the working directory
        raise EplbError(f"{what} is an empty name (an unset variable?): give a file name")
    p = Path(raw)
    try:
        if stat.S_ISLNK(p.lstat().st_mode):
            p.stat()  # where it leads: nothing (a broken link, the caller's to say), or back to itself
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise EplbError(f"{what} {shown(str(p))}: a symbolic link loop (the link leads back to itself); give "
                            "a file") from None
        raise EplbError(f"{what} {shown(str(p))}: the system cannot use this path ({exc.strerror or exc})") from None
    return p


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether paths a and b name one file: os.path.samefile when both exist (a symlink, ./x, a hard link), else
    their resolved paths agree."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, RuntimeError):  # a loop, a path the system refuses: told by `usable_path`
        return False


def refuse_input(out: str | Path, what: str, inputs: Iterable[tuple[str, str | Path | None]]) -> None:
    """EplbError when output `out` (named `what`, the flag) is one of the run's input files (`same_file`):
    inputs are (flag, path) pairs, a path None or empty where the flag was not given. Writing there would replace
    the input before, or instead of, anything else (a raw dump that cannot be recorded again). Every writer checks
    it before the work (`output_file`'s inputs; `eplb logs convert`)."""
    for flag, raw in inputs:
        if raw is not None and str(raw) != "" and same_file(out, raw):
            raise EplbError(f"{what} {out} is the input ({flag} {raw}): writing it would replace the input; write "
                            "to another name")


def _kind(p: Path) -> str:
    """What p, which exists and is neither a regular file nor a directory, is, for a message."""
    if p.is_char_device():
        return "a character device"
    if p.is_block_device():
        return "a block device"
    if p.is_fifo():
        return "a named pipe"
    if p.is_socket():
        return "a socket"
    return "another kind of file"


def output_file(raw: str | Path, what: str = "output file", suffixes: tuple[str, ...] = (),
                inputs: Iterable[tuple[str, str | Path | None]] = ()) -> Path:
    """The path of a file that can be written: not a directory, in a directory that exists. Call it before
    the work whose result goes there. suffixes: the names the file's format takes (`(".json",)`): a name ending in
    another suffix is refused (JSON was written under x.npz without a word); one without a suffix (/dev/stdout)
    is taken. inputs: the run's input files as (flag, path), none of which it may be (`refuse_input`)."""
    p = usable_path(raw, what)
    if str(raw) == "-":  # the usual name of standard output, which a file option does not write
        raise EplbError(f"{what} '-' would be a file named '-': give a file name (an output option writes a file, "
                        "not standard output)")
    if isinstance(raw, str) and raw.endswith(("/", os.sep)) and not p.is_dir():  # Path() drops the slash
        raise EplbError(f"{what} {raw} ends in '/' (a directory's name), but there is no such directory: give a "
                        f"file name, e.g. {p}")
    refuse_input(p, what, inputs)
    if suffixes and p.suffix and p.suffix.lower() not in suffixes:
        kind = suffixes[0].removeprefix(".").upper()
        raise EplbError(f"{what} {p}: the file is {kind}, but its name ends in {shown(p.suffix)}: name it "
                        f"{p.stem}{suffixes[0]}")
    if p.is_dir():
        raise EplbError(f"{what} {p} is a directory; give a file name inside it")
    if not p.parent.is_dir():
        there = next(a for a in p.absolute().parents if a.exists())
        if not there.is_dir():  # a file where a directory of the path should be
            raise EplbError(f"{what} {p}: cannot write there ({there} is not a directory)")
        raise EplbError(f"{what} {p}: directory {p.parent} does not exist; create it first")
    return p


@contextmanager
def writing(path: str | Path, what: str = "output file", name: str | None = None) -> Iterator[None]:
    """Run the block that writes `path` (checked before the work with `output_file` or `output_dir`): an OSError
    there (no such directory, an immutable file, a full disk, the directory replaced by a file meanwhile) is one
    EplbError naming `what` (the flag) and the path, `--out /proc/x.json: cannot write it (No such file or
    directory)`. name: a file written inside directory `path` (`--out DIR: cannot write steps.csv there (...)`).
    The CLI writes its files in it; the log writers (`eplb.io.logs`, `eplb.io.parquet`), `eplb.report.write_report`
    and `eplb.io.images.save_figure` catch the same errors themselves."""
    try:
        yield
    except OSError as exc:
        where = "it" if name is None else f"{name} there"
        raise EplbError(f"{what} {path}: cannot write {where} ({exc.strerror or exc})") from None


def replace_text(path: str | Path, text: str) -> None:
    """Write `text` to file `path` so that whoever reads it (a serving system polling its placement file, the
    next `--current`) finds the old file or the new one, never part of one, and a failed write (a full disk)
    leaves the old file as it was: a temporary file beside it, flushed to disk, then renamed over it, keeping an
    existing file's mode (a new one's follows the umask). Written in place instead: a path that exists and is
    not a regular file (a device, a FIFO: `/dev/stdout`), and a file in a directory the process may not create
    files in. Through a symlink its target is replaced. OSError as `open` raises it (`writing` names it)."""
    given = Path(path)
    if given.exists() and not given.is_file():  # followed as opened: /dev/stdout to a pipe resolves to no path
        given.write_text(text)
        return
    target = given.resolve() if given.is_symlink() else given
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except PermissionError:
        target.write_text(text)
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if target.exists():
            os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str, what: str = "output file") -> None:
    """Write `text` to `path` (`replace_text`), an OSError as one EplbError naming `what` (`writing`)."""
    with writing(path, what):
        replace_text(path, text)


def output_dir(raw: str | Path, what: str = "output directory", *, create: bool = False) -> Path:
    """The path of a directory to write files into: one that is there, or one that can be made (the nearest of
    its parents that is there a directory the process may write in). create: make it now, with its parents.
    Call it before the work whose results go there; EplbError naming `what` otherwise."""
    p = usable_path(raw, what)
    if p.exists() and not p.is_dir():
        raise EplbError(f"{what} {p}: exists and is not a directory")
    if create:
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EplbError(f"{what} {p}: cannot write there ({exc.strerror or exc})") from None
        return p
    there = next(a for a in (p.absolute(), *p.absolute().parents) if a.exists())
    if not there.is_dir():
        raise EplbError(f"{what} {p}: cannot write there ({there} is not a directory)")
    if not os.access(there, os.W_OK | os.X_OK):
        raise EplbError(f"{what} {p}: cannot write there (no permission to write in {there})")
    return p
