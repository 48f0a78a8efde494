"""One module per distributed stack; each is imported only when chosen.

``Backend`` and ``Config`` (:mod:`.base`, which imports torch) load on first use, so the command line
can read :mod:`.precision` without torch."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Type

from ..registry import SPECS

if TYPE_CHECKING:
    from .base import Backend, Config


def backend_class(name: str) -> Type["Backend"]:
    """The Backend subclass for ``name`` (one of ``detection.BACKENDS``), imported lazily."""
    return SPECS[name].load("backend_class")


def __getattr__(name: str) -> Any:
    if name in ("Backend", "Config"):
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Backend", "Config", "backend_class"]
