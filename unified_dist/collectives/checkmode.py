"""Check mode: ranks compare what collective they are about to run before running it.

Enabled by ``UNIFIED_DIST_DEBUG=1`` or ``ud.init(debug=True)``. Before each facade collective,
every rank all-gathers a small signature (operation, arguments, shapes, dtypes, call site).
If the ranks disagree, *every* rank raises the same :class:`CollectiveMismatch` listing what
each rank called -- instead of hanging, or silently reducing tensors of different meaning.
Costs one 8-byte all_gather per collective (a hash of the signature); the full signatures are
exchanged only when the hashes differ (see bench/).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any, Dict, List

import torch

from .. import nested
from ..errors import CollectiveError

_PAYLOAD = 2048
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # unified_dist/


class CollectiveMismatch(CollectiveError):
    """Ranks called different collectives, or the same one with incompatible tensors."""


def call_site() -> str:
    """``file.py:line`` of the first caller frame outside unified_dist."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(_PACKAGE_DIR) and "contextlib" not in filename:
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def signature(what: str, x: Any = None, **args: Any) -> Dict[str, Any]:
    """What this rank is about to do. ``x`` may be a nested structure; non-tensors show their type."""
    tensors = []
    for _, leaf in nested.leaves(x) if x is not None else []:
        if isinstance(leaf, torch.Tensor):
            tensors.append([str(leaf.dtype).replace("torch.", ""), list(leaf.shape)])
        else:
            tensors.append([type(leaf).__name__, None])
    return {"op": what, "args": args, "tensors": tensors, "site": call_site()}


def _describe(sig: Dict[str, Any]) -> str:
    args = ", ".join(f"{k}={v}" for k, v in sig["args"].items())
    tensors = " ".join(f"{d}{tuple(s)}" if s is not None else d for d, s in sig["tensors"])
    return f"{sig['op']}({args}) {tensors}".replace("  ", " ").strip() + f" at {sig['site']}"


def _comparable(sig: Dict[str, Any], ignore_dim0: bool) -> Any:
    tensors = [[d, (s[1:] if ignore_dim0 and s else s)] for d, s in sig["tensors"]]
    return sig["op"], sig["args"], tensors


def verify(backend: Any, sig: Dict[str, Any]) -> None:
    """Compare ``sig`` across ranks; raise the same error on every rank if they differ."""
    if backend.world_size == 1:
        return
    ignore_dim0 = sig["op"] in ("all_gather", "gather_for_metrics")
    key = json.dumps(_comparable(sig, ignore_dim0), sort_keys=True).encode()
    digest = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little", signed=True)
    hashes = backend.all_gather_equal(torch.tensor([digest], dtype=torch.int64, device=backend.device))
    if len(set(hashes.flatten().tolist())) == 1:
        return
    # every rank saw different hashes, so every rank takes part in the full exchange
    sigs = _exchange(backend, sig)
    listing = "; ".join(f"rank {r}: {_describe(s)}" for r, s in enumerate(sigs))
    raise CollectiveMismatch(f"collective mismatch (check mode): {listing}")


def _exchange(backend: Any, sig: Dict[str, Any]) -> List[Dict[str, Any]]:
    raw = json.dumps(sig, sort_keys=True).encode()
    if len(raw) > _PAYLOAD - 4:
        sig = dict(sig, tensors=sig["tensors"][:8] + [["...", None]])
        raw = json.dumps(sig, sort_keys=True).encode()[:_PAYLOAD - 4]
    buf = torch.zeros(_PAYLOAD, dtype=torch.uint8)
    buf[:4] = torch.tensor(list(len(raw).to_bytes(4, "little")), dtype=torch.uint8)
    buf[4:4 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    rows = backend.all_gather_equal(buf.to(backend.device)).cpu()
    sigs = []
    for row in rows:
        data = bytes(row.tolist())
        length = int.from_bytes(data[:4], "little")
        sigs.append(json.loads(data[4:4 + length].decode()))
    return sigs
