"""Which launcher started this process, and therefore which backend drives it.

Pure: reads an environment mapping, imports no backend, has no side effects. The facade
calls :func:`detect` once, at ``init``; tests call it with hand-made mappings.

Order (first match wins), and why:

1. ``init(backend=...)`` -- the user said so in code.
2. ``UNIFIED_DIST_BACKEND`` -- the user said so in the environment (e.g. a job script).
3. horovodrun (``HOROVOD_RANK``/``HOROVOD_SIZE``) -- only horovodrun (or ``mpirun`` driving
   Horovod) sets these, and a horovodrun job may itself be started from a shell that carries
   torchrun- or accelerate-like variables, so the most specific launcher goes first.
4. ``accelerate launch`` (``ACCELERATE_MIXED_PRECISION``/``ACCELERATE_USE_CPU``...) -- accelerate
   runs torch's elastic agent inside, so its workers *also* carry torchrun's variables
   (``TORCHELASTIC_RUN_ID``, ``RANK``, ``WORLD_SIZE``): it must be checked before torchrun.
5. torchrun (``TORCHELASTIC_RUN_ID``, or ``RANK`` + ``WORLD_SIZE`` set by any torch-style launcher
   such as ``srun`` scripts or ``torch.multiprocessing`` users).
6. Nothing: one plain process (world size 1; every collective returns its input).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple

BACKENDS: Tuple[str, ...] = ("torch", "accelerate", "horovod", "single")
"""Every backend name ``init(backend=...)`` accepts."""

ENV_BACKEND = "UNIFIED_DIST_BACKEND"

_HOROVOD_KEYS = ("HOROVOD_RANK", "HOROVOD_SIZE")
_ACCELERATE_KEYS = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU", "ACCELERATE_DYNAMO_BACKEND")
_TORCH_KEYS = ("RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class Detection:
    """The outcome of :func:`detect`.

    ``backend`` is one of :data:`BACKENDS`; ``launcher`` names what started the process
    (``"python"``, ``"torchrun"``, ``"accelerate"``, ``"horovodrun"``, or ``"explicit"``);
    ``reason`` is one human sentence. ``problems`` are contradictions in a launcher's
    environment (``init`` refuses to start on them, naming the right command); ``warnings`` are
    the same contradictions when the user chose the backend explicitly, so they only warn.
    """

    backend: str
    launcher: str
    reason: str
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    warnings: Tuple[str, ...] = field(default_factory=tuple)
    problems: Tuple[str, ...] = field(default_factory=tuple)


class DetectionError(ValueError):
    """The environment or the explicit choice cannot be honoured (one actionable line)."""


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise DetectionError(f"environment variable {key}={value!r} is not an integer; unset it or fix the launcher") from None


def _horovod(env: Mapping[str, str]) -> Detection:
    return Detection(
        "horovod", "horovodrun",
        "HOROVOD_RANK/HOROVOD_SIZE are set (started by horovodrun)",
        world_size=_int(env, "HOROVOD_SIZE", 1), rank=_int(env, "HOROVOD_RANK", 0),
        local_rank=_int(env, "HOROVOD_LOCAL_RANK", 0),
    )


def _torch_style(env: Mapping[str, str], backend: str, launcher: str, reason: str) -> Detection:
    return Detection(
        backend, launcher, reason,
        world_size=_int(env, "WORLD_SIZE", 1), rank=_int(env, "RANK", 0),
        local_rank=_int(env, "LOCAL_RANK", 0),
    )


def _half_set_torch_vars(env: Mapping[str, str]) -> Optional[str]:
    """Name the torch launcher variables that are set without their partners, if any."""
    present = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if env.get(k)]
    if not present or ("RANK" in present and "WORLD_SIZE" in present):
        return None
    missing = [k for k in ("RANK", "WORLD_SIZE") if k not in present]
    return (f"{', '.join(present)} set but {', '.join(missing)} missing: a distributed launch "
            f"half-configured; start with torchrun, or unset {', '.join(present)}, "
            f"or set {ENV_BACKEND}=single to run one process anyway")


def detect(env: Mapping[str, str], explicit: Optional[str] = None) -> Detection:
    """Decide the backend from ``explicit`` (``init(backend=...)``) and ``env`` (``os.environ``).

    Raises :class:`DetectionError` for an unknown backend name or unparsable variables.
    Never imports a backend library: whether the chosen one is installed is checked later.
    """
    if explicit is not None:
        return _choose(explicit, env, "explicit", f"init(backend={explicit!r})")
    forced = env.get(ENV_BACKEND)
    if forced:
        return _choose(forced, env, "env", f"{ENV_BACKEND}={forced}")
    return _from_launcher(env)


def _choose(name: str, env: Mapping[str, str], launcher_hint: str, why: str) -> Detection:
    name = name.strip().lower()
    if name not in BACKENDS:
        raise DetectionError(
            f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)} (or leave it unset to detect the launcher)")
    found = _from_launcher(env)
    if name == "single":
        return Detection("single", "python", f"{why}: one plain process", warnings=found.problems)
    if name == "horovod":
        base = _horovod(env) if any(k in env for k in _HOROVOD_KEYS) else Detection("horovod", "python", "")
    else:
        base = _torch_style(env, name, found.launcher, "")
    return Detection(name, found.launcher if found.backend != "single" else "python", why,
                     world_size=base.world_size, rank=base.rank, local_rank=base.local_rank,
                     warnings=found.problems)


def _from_launcher(env: Mapping[str, str]) -> Detection:
    if any(env.get(k) for k in _HOROVOD_KEYS):
        return _horovod(env)
    if any(env.get(k) for k in _ACCELERATE_KEYS):
        if env.get("WORLD_SIZE") and env.get("RANK"):
            return _torch_style(env, "accelerate", "accelerate",
                                "ACCELERATE_* and RANK/WORLD_SIZE are set (started by accelerate launch)")
        problems: Tuple[str, ...] = ()
        if env.get("MASTER_PORT") or env.get("MASTER_ADDR"):
            problems = (
                "accelerate launch asked for several processes but started them without a distributed "
                "launcher, so each one runs alone (world size 1). On a CPU machine run: accelerate launch "
                "--multi_gpu --num_processes N --num_machines 1 --mixed_precision no --dynamo_backend no script.py",
            )
        return Detection("accelerate", "accelerate",
                         "ACCELERATE_* is set without RANK/WORLD_SIZE (accelerate launch, one process)",
                         problems=problems)
    if env.get("TORCHELASTIC_RUN_ID") or all(env.get(k) for k in _TORCH_KEYS):
        return _torch_style(env, "torch", "torchrun",
                            "TORCHELASTIC_RUN_ID or RANK/WORLD_SIZE are set (started by torchrun)")
    half = _half_set_torch_vars(env)
    return Detection("single", "python", "no launcher variables: one plain process",
                     problems=(half,) if half else ())
