"""How an on/off environment variable reads (the one truthy spelling every switch accepts), and
the switches whose modules need torch, named here (their variables come from
:mod:`unified_dist.settings`) so the ``unified-dist`` command can offer them without importing it."""
from __future__ import annotations

from typing import Optional

from .settings import SHARDING_ENV, SYNC_BATCHNORM_ENV  # init(sharding=...)'s and init(sync_batchnorm=True)'s

TRUE_WORDS = ("1", "true", "yes", "on")
SHARDING_MODES = ("no", "fsdp")
"""``init(sharding=...)``'s choices (see :mod:`unified_dist.sharding`)."""


def is_set(value: Optional[str], default: bool = False) -> bool:
    """``value`` (an environment variable's text, ``None`` when unset) as a switch: ``default``
    when unset; otherwise on for 1/true/yes/on in any case and with spaces, off for anything else."""
    return default if value is None else value.strip().lower() in TRUE_WORDS
