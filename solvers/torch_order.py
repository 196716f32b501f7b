"""The order PyTorch's CPU `sort(descending=True)` gives to equal values.

DeepSeek EPLB sorts with `tensor.sort(-1, descending=True)`, which is not stable: on the CPU it runs the
C++ standard library's introsort (GCC's libstdc++), and rows longer than 16 come back with ties in an
order that depends on that algorithm. Replicas of one expert always tie, so reproducing DeepSeek's
`log2phy` exactly needs the same order. This module re-implements that introsort on indices; rows
without ties never need it (`argsort_desc_like_torch` takes the fast path for them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

_THRESHOLD = 16


def argsort_desc_like_torch(values: NDArray[Any]) -> NDArray[np.int64]:
    """Indices sorting each row of values [rows, n] descending, ties ordered as torch's CPU sort."""
    stable = np.argsort(-values, axis=1, kind="stable").astype(np.int64)
    if values.shape[1] <= _THRESHOLD:
        return stable  # insertion sort only: stable
    for row in range(values.shape[0]):
        v = values[row]
        if np.unique(v).size < v.size:
            stable[row] = _introsort(v.tolist())
    return stable


def _introsort(keys: list[Any]) -> list[int]:
    """libstdc++ std::sort of (key, index) pairs with comparator key_a > key_b; returns the indices."""
    a: list[tuple[Any, int]] = [(k, i) for i, k in enumerate(keys)]

    def comp(x: tuple[Any, int], y: tuple[Any, int]) -> bool:
        return bool(x[0] > y[0])

    n = len(a)
    if n > 1:
        _introsort_loop(a, 0, n, 2 * (n.bit_length() - 1), comp)
        _final_insertion_sort(a, 0, n, comp)
    return [i for _, i in a]


Comp = Callable[[tuple[Any, int], tuple[Any, int]], bool]


def _introsort_loop(a: list[tuple[Any, int]], first: int, last: int, depth: int, comp: Comp) -> None:
    while last - first > _THRESHOLD:
        if depth == 0:
            _heap_sort(a, first, last, comp)
            return
        depth -= 1
        cut = _partition_pivot(a, first, last, comp)
        _introsort_loop(a, cut, last, depth, comp)
        last = cut


def _partition_pivot(a: list[tuple[Any, int]], first: int, last: int, comp: Comp) -> int:
    mid = first + (last - first) // 2
    _median_to_first(a, first, first + 1, mid, last - 1, comp)
    lo, hi = first + 1, last
    while True:
        while comp(a[lo], a[first]):
            lo += 1
        hi -= 1
        while comp(a[first], a[hi]):
            hi -= 1
        if not lo < hi:
            return lo
        a[lo], a[hi] = a[hi], a[lo]
        lo += 1


def _median_to_first(a: list[tuple[Any, int]], result: int, x: int, y: int, z: int, comp: Comp) -> None:
    if comp(a[x], a[y]):
        if comp(a[y], a[z]):
            pick = y
        elif comp(a[x], a[z]):
            pick = z
        else:
            pick = x
    elif comp(a[x], a[z]):
        pick = x
    elif comp(a[y], a[z]):
        pick = z
    else:
        pick = y
    a[result], a[pick] = a[pick], a[result]


def _final_insertion_sort(a: list[tuple[Any, int]], first: int, last: int, comp: Comp) -> None:
    head = min(last, first + _THRESHOLD)
    for i in range(first + 1, head):
        val = a[i]
        if comp(val, a[first]):
            a[first + 1 : i + 1] = a[first:i]
            a[first] = val
        else:
            _linear_insert(a, i, comp)
    for i in range(head, last):
        _linear_insert(a, i, comp)


def _linear_insert(a: list[tuple[Any, int]], last: int, comp: Comp) -> None:
    val = a[last]
    j = last - 1
    while comp(val, a[j]):
        a[j + 1] = a[j]
        j -= 1
    a[j + 1] = val


def _heap_sort(a: list[tuple[Any, int]], first: int, last: int, comp: Comp) -> None:
    """libstdc++ __partial_sort(first, last, last): make_heap then sort_heap."""
    length = last - first
    if length >= 2:
        parent = (length - 2) // 2
        while True:
            _adjust_heap(a, first, parent, length, a[first + parent], comp)
            if parent == 0:
                break
            parent -= 1
    while last - first > 1:
        last -= 1
        value = a[last]
        a[last] = a[first]
        _adjust_heap(a, first, 0, last - first, value, comp)


def _adjust_heap(
    a: list[tuple[Any, int]], first: int, hole: int, length: int, value: tuple[Any, int], comp: Comp
) -> None:
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if comp(a[first + child], a[first + child - 1]):
            child -= 1
        a[first + hole] = a[first + child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        a[first + hole] = a[first + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and comp(a[first + parent], value):
        a[first + hole] = a[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    a[first + hole] = value
