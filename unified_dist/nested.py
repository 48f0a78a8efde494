"""The one walker over nested structures of tensors (collectives, check mode, data, checkpoints, elastic).

Containers are exactly ``dict`` (and its subclasses: ``OrderedDict``, Hugging Face
``ModelOutput``), ``list`` and ``tuple`` (namedtuples included); everything else is a leaf,
including mappings that are not dicts (``BatchEncoding`` is a ``UserDict``: a leaf with ``.to``).
A rebuilt container has the input's type: ``type(d)(pairs)``, ``type(nt)(*items)``, ``type(l)(items)``.
``torch.utils._pytree`` is not used: it treats unregistered dict subclasses as leaves.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

import torch

Rebuild = Callable[[Any, Sequence[Any]], Any]  # (original container, new items or (key, value) pairs) -> container


def same_type(container: Any, items: Sequence[Any]) -> Any:
    """``container``'s type rebuilt from ``items`` (``(key, value)`` pairs for a dict)."""
    if isinstance(container, tuple) and hasattr(container, "_fields"):
        return type(container)(*items)
    return type(container)(items)


def map_leaves(fn: Callable[[Any], Any], obj: Any, rebuild: Rebuild = same_type) -> Any:
    """``obj`` with every leaf replaced by ``fn(leaf)``; containers rebuilt by ``rebuild``."""
    if isinstance(obj, dict):
        return rebuild(obj, [(k, map_leaves(fn, v, rebuild)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return rebuild(obj, [map_leaves(fn, v, rebuild) for v in obj])
    return fn(obj)


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``; other leaves are kept as they are."""
    return map_leaves(lambda leaf: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf, obj)


def leaves(obj: Any, path: str = "x") -> Iterator[Tuple[str, Any]]:
    """``(path, leaf)`` for every leaf in order, the path written as indexing (``x['a'][0]``)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, obj


def first_non_tensor(obj: Any) -> Optional[Tuple[str, Any]]:
    """``(path, leaf)`` of the first leaf that is not a tensor, or ``None`` when all are."""
    return next(((path, leaf) for path, leaf in leaves(obj) if not isinstance(leaf, torch.Tensor)), None)
