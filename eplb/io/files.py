"""Checks the file readers of eplb.io share: input paths, JSON text, numeric and integer tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from eplb.errors import EplbError


def int_table(value: Any, what: str) -> NDArray[np.int64]:
    arr = numeric_array(value, what)
    if arr.ndim != 2:
        raise EplbError(f"{what} must be [layers][slots], got shape {list(arr.shape)}")
    if arr.size == 0:
        raise EplbError(f"{what} is empty")
    if not np.all(np.mod(arr, 1) == 0):
        raise EplbError(f"{what} must hold integer expert ids")
    return arr.astype(np.int64)


def int_list(value: Any, what: str) -> list[int]:
    arr = numeric_array(value, what)
    if arr.ndim != 1 or not np.all(np.mod(arr, 1) == 0):
        raise EplbError(f"{what} must be a list of integers")
    return [int(v) for v in arr]


def numeric_array(value: Any, what: str) -> NDArray[np.float64]:
    if isinstance(value, list):
        check_rectangular(value, what)
    return real_array(value, what, f"{what} must hold only numbers")


def real_array(value: Any, what: str, not_numbers: str) -> NDArray[np.float64]:
    """`value` (rectangular) as float64; EplbError `not_numbers` when it holds no numbers, and by name for an
    array of other than integers or floats (bool, complex: numpy would drop the imaginary part) or the first
    true/false in nested lists (JSON's true is no number; numpy would read it as 1)."""
    if isinstance(value, np.ndarray) and value.dtype.kind not in "iuf":
        raise EplbError(f"{what} must hold real numbers (integers or floats), got dtype {value.dtype}")
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (ValueError, TypeError):
        raise EplbError(not_numbers) from None
    if not isinstance(value, np.ndarray):  # a bool reads as 0 or 1: only those cells need a look
        for where in np.argwhere((arr == 0) | (arr == 1)):
            cell = value
            for i in where:
                cell = cell[i]
            if isinstance(cell, bool):
                index = "".join(f"[{i}]" for i in where)
                raise EplbError(f"{what}{index} is {str(cell).lower()}: give a number, not true/false")
    return arr


def check_rectangular(rows: list[Any], what: str) -> None:
    if not rows or not all(isinstance(r, list) for r in rows):
        return
    for i, r in enumerate(rows):
        if len(r) != len(rows[0]):
            raise EplbError(f"{what} is ragged: row 0 has {len(rows[0])} entries, row {i} has {len(r)}")
    for i, r in enumerate(rows):
        check_rectangular(r, f"{what}[{i}]")


def read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EplbError(f"{p}: not valid JSON ({exc})") from None


def existing_file(raw: str | Path, what: str = "file") -> Path:
    """The path of a readable, non-empty file; otherwise an EplbError that says which of those it is not."""
    p = Path(raw)
    if p.is_dir():
        raise EplbError(f"{what} {p} is a directory; give a file")
    if not p.is_file():
        raise EplbError(f"{what} not found: {p}")
    if p.stat().st_size == 0:
        raise EplbError(f"{what} {p} is empty (0 bytes)")
    return p


def output_file(raw: str | Path, what: str = "output file") -> Path:
    """The path of a file that can be written: not a directory, in a directory that exists. Call it before
    the work whose result goes there."""
    p = Path(raw)
    if p.is_dir():
        raise EplbError(f"{what} {p} is a directory; give a file name inside it")
    if not p.parent.is_dir():
        raise EplbError(f"{what} {p}: directory {p.parent} does not exist; create it first")
    return p
