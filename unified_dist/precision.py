"""Which mixed-precision mode to run, from the code, the launcher, or the default."""
from __future__ import annotations

from typing import Mapping, Optional

from .errors import PrecisionError
from .settings import MIXED_PRECISION_ENV as ENV_VAR

MODES = ("no", "bf16", "fp16")
"""Every mixed-precision mode, for ``init``, ``unified-dist launch --mixed-precision`` and ``ENV_VAR``."""


def resolve_mixed_precision(explicit: Optional[str], env: Mapping[str, str], cuda: bool) -> str:
    """``init(mixed_precision=...)`` > ``accelerate launch --mixed_precision`` > ``UNIFIED_DIST_MIXED_PRECISION`` > "no".

    Raises :class:`PrecisionError` for an unknown mode or fp16 without a CUDA device.
    """
    mode = explicit or env.get("ACCELERATE_MIXED_PRECISION") or env.get(ENV_VAR) or "no"
    mode = str(mode).strip().lower()
    if mode not in MODES:
        raise PrecisionError(f"unknown mixed precision {mode!r}; use one of {', '.join(MODES)}")
    check_device(mode, cuda)
    return mode


def check_device(mode: str, cuda: bool, spelling: str = "mixed_precision='{}'") -> None:
    """Raise :class:`PrecisionError` when this machine cannot run ``mode``: fp16 needs a CUDA GPU.

    ``spelling`` writes the setting in the fix (``"--mixed-precision {}"`` for the command line).
    """
    if mode == "fp16" and not cuda:
        raise PrecisionError(f"fp16 mixed precision needs a CUDA GPU; on CPU use {spelling.format('bf16')} or 'no'")
