"""``accelerate.utils``, forwarded: ``from unified_dist.accelerate.utils import set_seed`` gives
Accelerate's own ``set_seed`` (seeds Python, NumPy and torch in this process; identical under every
launcher, since it only touches this process's generators)."""
from __future__ import annotations

from typing import Any

from accelerate.utils import set_seed


def __getattr__(name: str) -> Any:
    """Every other name of ``accelerate.utils`` (PEP 562): the same object."""
    import accelerate.utils

    return getattr(accelerate.utils, name)


__all__ = ["set_seed"]
