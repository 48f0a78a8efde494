"""Errors raised by unified_dist. Each message is one line that names the fix."""


class UnifiedDistError(RuntimeError):
    """Base class of every error unified_dist raises on purpose."""


class BackendNotInstalled(UnifiedDistError, ImportError):
    """The chosen backend's library cannot be imported."""


class CollectiveError(UnifiedDistError, ValueError):
    """A collective got input it cannot honour (wrong type, op, or shapes that differ across ranks)."""


class PrecisionError(UnifiedDistError, ValueError):
    """A mixed-precision mode this device cannot run."""


class CheckpointError(UnifiedDistError):
    """A checkpoint is missing, truncated, foreign, or would execute code on load."""
