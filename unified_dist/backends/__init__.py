"""One module per distributed stack; each is imported only when chosen."""
from __future__ import annotations

import importlib
from typing import Type

from .base import Backend, Config

_MODULES = {
    "single": ("single", "SingleProcessBackend"),
    "torch": ("torch_ddp", "TorchBackend"),
    "accelerate": ("accelerate_backend", "AccelerateBackend"),
    "horovod": ("horovod_backend", "HorovodBackend"),
}


def backend_class(name: str) -> Type[Backend]:
    """The Backend subclass for ``name`` (one of ``detection.BACKENDS``), imported lazily."""
    module, cls = _MODULES[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


__all__ = ["Backend", "Config", "backend_class"]
