"""``accelerate.logging``, forwarded: ``get_logger(name)`` is Accelerate's own, whose records go out on
the main process only (``main_process_only=True``) or on every process. Its rank comes from the
``Accelerator``'s state, so create the :class:`~unified_dist.accelerate.Accelerator` before logging
(Accelerate asks the same)."""
from __future__ import annotations

from accelerate.logging import MultiProcessAdapter, get_logger

__all__ = ["MultiProcessAdapter", "get_logger"]
