"""Errors raised by unified_dist. Each message is one line that names the fix.

Every exception class the library defines derives from :class:`UnifiedDistError`
(``tests/unit/test_errors.py`` checks it).
"""
import warnings
from typing import Optional

_warned: set = set()


def warn_once(message: str) -> None:
    """A ``UserWarning`` the first time ``message`` is said in this process (a loop repeats the mistake)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"unified_dist: {message}", UserWarning, stacklevel=4)


class UnifiedDistError(RuntimeError):
    """Base class of every error unified_dist raises on purpose."""


class BackendNotInstalled(UnifiedDistError, ImportError):
    """The chosen backend's library cannot be imported."""


class CollectiveError(UnifiedDistError, ValueError):
    """A collective got input it cannot honour (wrong type, op, or shapes that differ across ranks)."""


class ShapeMismatch(CollectiveError):
    """A backend's native uneven gather refused tensors whose trailing dims or dtypes differ; the
    collectives layer replaces it with the message naming every rank's shape."""


class PrecisionError(UnifiedDistError, ValueError):
    """A mixed-precision mode this device cannot run."""


class CheckpointError(UnifiedDistError):
    """A checkpoint is missing, truncated, foreign, or would execute code on load."""


class CollectiveTimeout(UnifiedDistError, TimeoutError):
    """A collective did not complete within ``init(timeout=...)``.

    ``collective`` names it; ``None`` when a backend that keeps its own deadline raised it from a
    primitive (:func:`deadline_passed`): the collectives layer then names it.
    """

    collective: Optional[str] = "?"


class PeerLost(UnifiedDistError, ConnectionError):
    """Another rank of the job died while this one was communicating."""


class SettingError(UnifiedDistError, ValueError):
    """A setting's value does not read (``UNIFIED_DIST_SYNC_BATCHNORM=maybe``); the message names
    what it accepts (see :mod:`unified_dist.settings`)."""


class LaunchError(UnifiedDistError, ValueError):
    """The launcher's environment contradicts itself; the message names the right command."""


class PipelineError(UnifiedDistError, ValueError):
    """Pipeline parallelism cannot run what was asked (a model the split cannot cut, a schedule that hangs
    on gloo, a batch the microbatches do not divide, ``model(batch)`` of a pipelined model); the
    message names the fix (see :mod:`unified_dist.parallel.pipeline`)."""


class NonFiniteLoss(UnifiedDistError, FloatingPointError):
    """A rank's loss is NaN or infinite; every rank stops at the same step."""


class WorkerFailed(UnifiedDistError):
    """A worker started by ``ud.launch`` raised; ``rank`` says which (``None``: it died without
    raising) and ``remote_traceback`` holds its traceback text."""

    def __init__(self, message: str, rank: "int | None" = None, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def deadline_passed(seconds: float) -> CollectiveTimeout:
    """What a backend raises when its own wait outlives the timeout (the collective not yet named)."""
    exc = CollectiveTimeout(f"timed out after {seconds:.0f}s waiting for the other ranks")
    exc.collective = None
    return exc


def collective_timeout(what: str, rank: int, seconds: int, cause: BaseException) -> CollectiveTimeout:
    """The one-line error of a collective ``what`` that outlived the timeout on ``rank``."""
    exc = CollectiveTimeout(
        f"{what} timed out after {seconds}s on rank {rank}: another rank is stuck, dead or calling a "
        f"different collective ({first_line(cause)[:200]}); rerun with UNIFIED_DIST_DEBUG=1 to compare "
        "collectives across ranks")
    exc.collective = what
    return exc


def peer_lost_message(what: str, rank: int, cause: BaseException) -> str:
    """The one-line message of :class:`PeerLost` for collective ``what`` on ``rank``."""
    return (f"{what} failed on rank {rank}: a peer process is gone ({first_line(cause)[:200]}); "
            "the launcher's log names the rank that exited first")


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def summary(exc: BaseException) -> str:
    """``Type: first line`` of ``exc`` (just ``Type`` when it has no message)."""
    return f"{type(exc).__name__}: {first_line(exc)}" if str(exc).strip() else type(exc).__name__
