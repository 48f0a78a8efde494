"""What :func:`unified_dist.detection.detect` returns, and the helpers every source of it shares."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Tuple

from ..errors import UnifiedDistError


@dataclass(frozen=True)
class Live:
    """A distributed stack that is already initialised in this process (found by the facade).

    ``stack`` is ``"horovod"``, ``"accelerate"`` or ``"torch"``; ``local_rank`` is ``None`` when
    the stack does not know it (a bare ``init_process_group``): the backend then works it out.
    """

    stack: str
    world_size: int
    rank: int
    local_rank: Optional[int] = None


@dataclass(frozen=True)
class Detection:
    """The outcome of :func:`detect`.

    ``backend`` is one of :data:`unified_dist.detection.BACKENDS`; ``launcher`` names what started the process
    (``"python"``, ``"torchrun"``, ``"accelerate"``, ``"horovodrun"``, ``"srun"``, ``"mpirun"``,
    ``"ud.launch"``, or ``"existing"`` for a group the process had already joined);
    ``reason`` is one human sentence. ``master_addr``/``master_port`` are the rendezvous a
    torch-style backend must use where the launcher did not export one (srun, mpirun).
    ``adopt`` is true when the backend must use the running stack and never tear it down.
    ``problems`` are contradictions in a launcher's environment (``init`` refuses to start on
    them, naming the right command); ``warnings`` are the same contradictions when the user
    chose the backend explicitly, so they only warn.
    """

    backend: str
    launcher: str
    reason: str
    world_size: int = 1
    rank: int = 0
    local_rank: Optional[int] = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    adopt: bool = False
    warnings: Tuple[str, ...] = field(default_factory=tuple)
    problems: Tuple[str, ...] = field(default_factory=tuple)


class DetectionError(UnifiedDistError, ValueError):
    """The environment or the explicit choice cannot be honoured (one actionable line)."""


def read_int(env: Mapping[str, str], key: str, default: int) -> int:
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise DetectionError(f"environment variable {key}={value!r} is not an integer; "
                             "unset it or fix the launcher") from None


def first_set(env: Mapping[str, str], keys: Sequence[str]) -> Optional[str]:
    return next((env[k] for k in keys if env.get(k)), None)
