"""Every ``UNIFIED_DIST_*`` environment variable, declared once: :data:`SETTINGS`.

An environment variable that nobody reads fails silently: ``UNIFIED_DIST_SYNC_BATCHNORM=1``
spelled without its last underscore trains without synchronised BatchNorm and says nothing.
So every variable the library, its launchers, its tools and its Makefile read is named here
(tests/test_settings.py fails when a ``UNIFIED_DIST_*`` name appears in the code and not here),
and anything else under that prefix is a misspelling: :func:`unknown_variables` finds it with
the closest known name, ``ud.init`` warns about it (:func:`warn_unknown`), and
``unified-dist env`` lists it among its problems, next to the settings in effect
(:func:`in_effect`).

The modules that read a variable import its name from here; how each value is parsed still
lives with its reader (e.g. :func:`unified_dist.precision.resolve_mixed_precision`).
Importing this module is free: it imports nothing but the standard library.
"""
from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Set, Tuple, Union

PREFIX = "UNIFIED_DIST_"

BACKEND_ENV = "UNIFIED_DIST_BACKEND"
MIXED_PRECISION_ENV = "UNIFIED_DIST_MIXED_PRECISION"
TIMEOUT_ENV = "UNIFIED_DIST_TIMEOUT"
DEBUG_ENV = "UNIFIED_DIST_DEBUG"
SHARDING_ENV = "UNIFIED_DIST_SHARDING"
SYNC_BATCHNORM_ENV = "UNIFIED_DIST_SYNC_BATCHNORM"
GRADIENT_COMPRESSION_ENV = "UNIFIED_DIST_GRADIENT_COMPRESSION"
BUCKET_MB_ENV = "UNIFIED_DIST_BUCKET_MB"
BUCKET_VIEW_ENV = "UNIFIED_DIST_BUCKET_VIEW"
CHECK_FINITE_ENV = "UNIFIED_DIST_CHECK_FINITE"
SLURM_ENV = "UNIFIED_DIST_SLURM"
LAUNCHER_ENV = "UNIFIED_DIST_LAUNCHER"
WHEEL_CACHE_ENV = "UNIFIED_DIST_WHEEL_CACHE"
WITHOUT_HOROVOD_ENV = "UNIFIED_DIST_WITHOUT_HOROVOD"

_SWITCH = "1, true, yes, on (any case) for on; anything else off"


@dataclass(frozen=True)
class Setting:
    """One environment variable.

    ``keyword`` is the ``ud.init`` keyword it is the default of (``None``: no keyword; the
    keyword, when given, wins over the variable). ``values`` is a tuple of the choices it
    accepts, or what it accepts in words; ``default`` is what holds while it is unset.
    """

    variable: str
    keyword: Optional[str]
    values: Union[Tuple[str, ...], str]
    default: str
    help: str

    def accepted(self) -> str:
        """``values`` as one line of text."""
        return " | ".join(self.values) if isinstance(self.values, tuple) else self.values


SETTINGS: Dict[str, Setting] = {s.variable: s for s in (
    Setting(BACKEND_ENV, "backend", ("torch", "accelerate", "horovod", "single"), "detected from the launcher",
            "the backend to drive, whatever the launcher's variables say (ud.launch sets it in its workers)"),
    Setting(MIXED_PRECISION_ENV, "mixed_precision", ("no", "bf16", "fp16"), "no",
            "autocast mode (fp16 needs a CUDA GPU); accelerate launch --mixed_precision wins over it"),
    Setting(TIMEOUT_ENV, "timeout", "seconds (> 0)", "600",
            "how long one collective may wait for the other ranks before it fails"),
    Setting(DEBUG_ENV, "debug", _SWITCH, "off",
            "check mode: ranks compare each collective's signature before running it"),
    Setting(SHARDING_ENV, "sharding", ("no", "fsdp"), "no",
            "fsdp: ud.prepare shards models with FSDP2 (torch, accelerate); accelerate launch --use_fsdp wins"),
    Setting(SYNC_BATCHNORM_ENV, "sync_batchnorm", _SWITCH, "off",
            "ud.prepare makes BatchNorm layers compute statistics over the global batch"),
    Setting(GRADIENT_COMPRESSION_ENV, "gradient_compression", ("bf16", "fp16", "none"), "none (float32)",
            "the format gradients travel in for the all-reduce (DDP's hook, Horovod's compressor)"),
    Setting(BUCKET_MB_ENV, "bucket_mb", "MiB (> 0)", "each stack's own (DDP 25, Horovod 128)",
            "size of one fused gradient reduction: DDP's buckets, Horovod's fusion buffer"),
    Setting(BUCKET_VIEW_ENV, None, _SWITCH, "on",
            "DDP keeps gradients as views into its buckets; off for code that replaces .grad in place"),
    Setting(CHECK_FINITE_ENV, None, "0 for off; anything else on", "on",
            "ud.backward stops every rank at the same step when any rank's loss is NaN/inf"),
    Setting(SLURM_ENV, None, "0 for off; anything else on", "on",
            "detection reads srun's variables (off: srun -n N without torchrun is refused)"),
    Setting(LAUNCHER_ENV, None, "a launcher's name", "the detected launcher",
            "set by ud.launch in its workers: the name ud.launcher() reports"),
    Setting(WHEEL_CACHE_ENV, None, "a directory", "$XDG_CACHE_HOME (or ~/.cache)/unified_dist/wheels",
            "where `make setup` (tools/build_horovod.sh) keeps the Horovod wheel it builds"),
    Setting(WITHOUT_HOROVOD_ENV, None, "1 for on; anything else off", "off",
            "1: `make setup` leaves Horovod out and the test suite skips its tests"),
)}
"""Every ``UNIFIED_DIST_*`` variable anything in this repository reads, in the order
``unified-dist env`` lists them."""


def unknown_variables(environ: Mapping[str, str]) -> List[Tuple[str, Optional[str]]]:
    """Each ``UNIFIED_DIST_*`` name in ``environ`` (in any case) that no setting declares, with the
    closest declared name (``None`` when none is close), sorted by name. Pure."""
    suffixes = {name[len(PREFIX):]: name for name in SETTINGS}
    found = []
    for name in sorted(environ):
        if not name.upper().startswith(PREFIX) or name in SETTINGS:
            continue
        # Compare what follows the prefix: the shared prefix alone would make every name "close".
        close = difflib.get_close_matches(name[len(PREFIX):].upper(), list(suffixes), n=1, cutoff=0.6)
        found.append((name, suffixes[close[0]] if close else None))
    return found


def describe_unknown(name: str, suggestion: Optional[str]) -> str:
    """One line about an unknown variable, for ``ud.init``'s warning and ``unified-dist env``."""
    hint = f"did you mean {suggestion}?" if suggestion else "`unified-dist env` lists the known ones"
    return f"{name} is not a unified_dist setting and is ignored; {hint}"


_warned: Set[str] = set()


def warn_unknown(environ: Mapping[str, str], stacklevel: int = 3) -> List[Tuple[str, Optional[str]]]:
    """Warn (``UserWarning``, once per process for each name) about the unknown ``UNIFIED_DIST_*``
    variables in ``environ``; return all of them, as :func:`unknown_variables` does.

    ``stacklevel`` 3 points the warning at the caller of the function that calls this one
    (``ud.init``'s caller).
    """
    unknown = unknown_variables(environ)
    fresh = [(name, suggestion) for name, suggestion in unknown if name not in _warned]
    if fresh:
        _warned.update(name for name, _ in fresh)
        warnings.warn("unified_dist: " + "; ".join(describe_unknown(*item) for item in fresh),
                      UserWarning, stacklevel=stacklevel)
    return unknown


def in_effect(environ: Mapping[str, str]) -> List[Dict[str, Optional[str]]]:
    """Every setting as ``environ`` gives it: ``variable``, ``value`` (the variable's text, or the
    default), ``source`` (``"environment"`` or ``"default"``), ``keyword`` (the ``ud.init`` keyword
    that overrides it in a script, or ``None``), ``accepted`` and ``help``. JSON-ready."""
    rows = []
    for setting in SETTINGS.values():
        value = environ.get(setting.variable)
        rows.append({"variable": setting.variable,
                     "value": setting.default if value is None else value,
                     "source": "default" if value is None else "environment",
                     "keyword": setting.keyword, "accepted": setting.accepted(), "help": setting.help})
    return rows
