"""Mixed precision, in one object: what a mode (a setting, :mod:`unified_dist.settings`) means on this
machine and to each library.

:class:`Precision` owns the mode → dtype map, the autocast context, the loss-scaling policy (one
``GradScaler`` for fp16, shared by every prepared optimizer: the session asks once) and the policy
FSDP2 is given; the backends and the sharding code ask it instead of spelling dtypes themselves.
Imports torch only when a method needs it (the command line checks modes without torch).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager, Optional

from ..errors import PrecisionError

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
"""The floating-point type each mixed-precision mode computes in (``"no"``: float32 throughout)."""


@dataclass(frozen=True)
class Precision:
    """Mode ``"no"``, ``"bf16"`` or ``"fp16"`` and what it asks of torch."""

    mode: str = "no"

    @property
    def dtype(self) -> Optional[Any]:
        """The ``torch.dtype`` autocast computes in, ``None`` for ``"no"``."""
        if self.mode not in DTYPES:
            return None
        import torch

        return getattr(torch, DTYPES[self.mode])

    def check_device(self, cuda: bool, spelling: str = "mixed_precision='{}'") -> None:
        """Raise :class:`PrecisionError` when this machine cannot run the mode: fp16 needs a CUDA GPU.

        ``spelling`` writes the setting in the fix (``"--mixed-precision {}"`` for the command line).
        """
        if self.mode == "fp16" and not cuda:
            raise PrecisionError(f"fp16 mixed precision needs a CUDA GPU; on CPU use {spelling.format('bf16')} "
                                 "or 'no'")

    def autocast(self, device_type: str) -> ContextManager:
        """``torch.autocast`` in the mode's dtype on ``device_type``; a no-op context for ``"no"``."""
        if self.dtype is None:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(device_type=device_type, dtype=self.dtype)

    def grad_scaler(self, device_type: str) -> Optional[Any]:
        """A new ``GradScaler`` when the mode needs loss scaling (fp16), else ``None``. The session
        asks once and every prepared optimizer shares it: one loss scale for the whole step."""
        if self.mode != "fp16":
            return None
        import torch

        return torch.amp.GradScaler(device_type)

    def fsdp_policy(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy``: parameters in the mode's dtype, gradients reduced in float32
        (``None`` and ``None`` for ``"no"``)."""
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32 if self.dtype else None)
