"""One module per distributed stack; each is imported only when chosen."""
from __future__ import annotations

from typing import Type

from ..registry import SPECS
from .base import Backend, Config


def backend_class(name: str) -> Type[Backend]:
    """The Backend subclass for ``name`` (one of ``detection.BACKENDS``), imported lazily."""
    return SPECS[name].load("backend_class")


__all__ = ["Backend", "Config", "backend_class"]
