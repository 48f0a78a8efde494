"""Which mixed-precision mode to run, from the code, the launcher, or the default."""
from __future__ import annotations

from typing import Mapping, Optional

from .errors import PrecisionError

MODES = ("no", "bf16", "fp16")
"""Every mixed-precision mode, for ``init``, ``unified-dist launch --mixed-precision`` and the variable below."""
ENV_VAR = "UNIFIED_DIST_MIXED_PRECISION"
"""The variable ``unified-dist launch`` sets for launchers without a precision flag of their own."""


def resolve_mixed_precision(explicit: Optional[str], env: Mapping[str, str], cuda: bool) -> str:
    """``init(mixed_precision=...)`` > ``accelerate launch --mixed_precision`` > ``UNIFIED_DIST_MIXED_PRECISION`` > "no".

    Raises :class:`PrecisionError` for an unknown mode or fp16 without a CUDA device.
    """
    mode = explicit or env.get("ACCELERATE_MIXED_PRECISION") or env.get(ENV_VAR) or "no"
    mode = str(mode).strip().lower()
    if mode not in MODES:
        raise PrecisionError(f"unknown mixed precision {mode!r}; use one of {', '.join(MODES)}")
    if mode == "fp16" and not cuda:
        raise PrecisionError("fp16 mixed precision needs a CUDA GPU; on CPU use mixed_precision='bf16' or 'no'")
    return mode
