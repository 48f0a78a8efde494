"""SLURM's compressed host lists (``node[01-03,7],gpu-a[1-2]-ib``), expanded in Python.

``scontrol show hostnames`` does the same, but it is not on every compute image and needs the
controller; a process started by ``srun`` only has the string. Pure (it imports only the errors).
"""
from __future__ import annotations

import re
from typing import List

from ..errors import UnifiedDistError

_BRACKET = re.compile(r"\[([^\[\]]*)\]")


class HostListError(UnifiedDistError, ValueError):
    """A host list that SLURM would not have written (unbalanced brackets, a bad range)."""


def expand(hostlist: str) -> List[str]:
    """Every host of ``hostlist`` in SLURM's order: ``"n[01-02,7]"`` -> ``["n01", "n02", "n7"]``.

    Zero padding of a range is kept (``01-10`` gives ``01 .. 10``); several bracket groups in
    one name expand as a product (``r[1-2]-n[1-2]`` -> ``r1-n1, r1-n2, r2-n1, r2-n2``).
    """
    hosts: List[str] = []
    for item in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(text: str) -> List[str]:
    """Split on the commas that are outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostListError(f"unbalanced ']' in host list {text!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise HostListError(f"unbalanced '[' in host list {text!r}")
    items.append(text[start:])
    return [item for item in items if item]


def _expand_one(pattern: str) -> List[str]:
    match = _BRACKET.search(pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    return [head + middle + rest for middle in _ranges(match.group(1), pattern) for rest in _expand_one(tail)]


def _ranges(spec: str, pattern: str) -> List[str]:
    out: List[str] = []
    for part in spec.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise HostListError(f"bad range {part!r} in host list {pattern!r}")
        if not sep:
            out.append(lo)
            continue
        width = len(lo) if lo.startswith("0") else 0
        if int(hi) < int(lo):
            raise HostListError(f"descending range {part!r} in host list {pattern!r}")
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out
