"""Whether this machine can run a mixed-precision mode (the mode itself is a setting: :mod:`unified_dist.settings`)."""
from __future__ import annotations

from ..errors import PrecisionError


def check_device(mode: str, cuda: bool, spelling: str = "mixed_precision='{}'") -> None:
    """Raise :class:`PrecisionError` when this machine cannot run ``mode``: fp16 needs a CUDA GPU.

    ``spelling`` writes the setting in the fix (``"--mixed-precision {}"`` for the command line).
    """
    if mode == "fp16" and not cuda:
        raise PrecisionError(f"fp16 mixed precision needs a CUDA GPU; on CPU use {spelling.format('bf16')} or 'no'")
