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


class CollectiveTimeout(UnifiedDistError, TimeoutError):
    """A collective did not complete within ``init(timeout=...)``."""


class PeerLost(UnifiedDistError, ConnectionError):
    """Another rank of the job died while this one was communicating."""


class LaunchError(UnifiedDistError, ValueError):
    """The launcher's environment contradicts itself; the message names the right command."""


class NonFiniteLoss(UnifiedDistError, FloatingPointError):
    """A rank's loss is NaN or infinite; every rank stops at the same step."""


class WorkerFailed(UnifiedDistError):
    """A worker started by ``ud.launch`` raised; ``rank`` says which (``None``: it died without
    raising) and ``remote_traceback`` holds its traceback text."""

    def __init__(self, message: str, rank: "int | None" = None, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
