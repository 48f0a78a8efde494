"""How an on/off environment variable reads: the one truthy spelling every switch accepts."""
from __future__ import annotations

from typing import Optional

TRUE_WORDS = ("1", "true", "yes", "on")


def is_set(value: Optional[str], default: bool = False) -> bool:
    """``value`` (an environment variable's text, ``None`` when unset) as a switch: ``default``
    when unset; otherwise on for 1/true/yes/on in any case and with spaces, off for anything else."""
    return default if value is None else value.strip().lower() in TRUE_WORDS
