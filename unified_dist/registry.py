"""Every backend unified_dist knows, described once: :data:`SPECS`.

Everything that used to keep its own table of backend names reads this module: the facade
(:func:`unified_dist.backends.backend_class`), detection (:data:`unified_dist.detection.BACKENDS`),
``ud.launch`` (:mod:`unified_dist.spawn`), the command line (``launch``, ``env``, ``test``,
``parity``), the benchmarks and the tests' launcher table.

Importing this module is free: it imports nothing but the standard library. The code a spec
names (its Backend class, launch-command builder, environment probe, ``ud.launch`` starter) is
written as ``"module:attribute"`` and imported only by :meth:`BackendSpec.load`, when used, so
listing Horovod here never imports Horovod.

Adding a backend: a spec here, its Backend subclass, the source that recognises its launcher's
variables (:mod:`unified_dist.detection.stacks`) and its place in :mod:`unified_dist.detection`'s
order. Its builder, probe and starter may live in the backend's own module; the spec names them.
"""
from __future__ import annotations

import os
import pkgutil
import shutil
import sys
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple


@dataclass(frozen=True)
class BackendSpec:
    """What one backend is.

    ``name`` is what ``init(backend=...)``, ``UNIFIED_DIST_BACKEND`` and ``--backend`` accept.
    ``backend_class`` is the :class:`~unified_dist.backends.Backend` subclass that drives it.
    ``library`` is the import (and distribution) name of the package it needs (``None``: torch
    alone is enough and nothing is probed separately). ``launcher`` is the command that starts it
    on several processes and also what ``ud.launcher()`` reports for it (``None``: plain
    ``python``, one process). ``install_fix`` says how to get library and launcher.
    ``launcher_keys`` are variables only its launcher sets (its ``source`` reads them: the
    detection function that recognises its launcher, ``env -> Detection | None``);
    ``variable_prefix`` starts every variable its launcher exports (a job started from inside
    such a process must not inherit them). ``command`` builds its native launch command
    (``(Plan, cuda, environ) -> Command``, see :mod:`unified_dist.cli.launch`); ``probe`` reports
    whether it works here (``environ -> dict``, see :mod:`unified_dist.cli.env_report`); ``start``
    starts ``ud.launch``'s workers (see :mod:`unified_dist.spawn`). The last three are
    ``"module:attribute"`` references. ``selftest``: whether ``unified-dist test`` (the contract's checks,
    :data:`unified_dist.checks.contract.CHECKS`) runs on it by default; ``contract``: whether the tests' whole
    contract suite (``tests/launchers/test_contract_under_launchers.py``: accumulation, loaders, checkpoints across
    backends, adoption) runs under its launcher; a backend that does not run that suite has its own launch tests.
    ``sharding``: whether torch's layouts (``sharding``, ``tp``,
    ``dp_replicate``) run on it (its Backend class's ``supports_sharding`` is this; ``unified-dist launch`` reads it
    here, without importing torch).
    """

    name: str
    backend_class: str
    probe: str
    library: Optional[str] = None
    launcher: Optional[str] = None
    install_fix: str = ""
    launcher_keys: Tuple[str, ...] = ()
    variable_prefix: Optional[str] = None
    command: Optional[str] = None
    start: Optional[str] = None
    source: Optional[str] = None
    selftest: bool = True
    contract: bool = True
    sharding: bool = True

    def load(self, field: str) -> Any:
        """The object the ``field`` reference (e.g. ``"command"``) names, imported now."""
        reference = getattr(self, field)
        if reference is None:
            raise LookupError(f"backend {self.name!r} has no {field}")
        return pkgutil.resolve_name(reference)


_CLI = "unified_dist.cli"
_DETECT = "unified_dist.detection.stacks"
SPECS: Dict[str, BackendSpec] = {spec.name: spec for spec in (
    BackendSpec(
        name="torch", backend_class="unified_dist.backends.torch_ddp:TorchBackend", library="torch",
        launcher="torchrun", launcher_keys=("TORCHELASTIC_RUN_ID",), variable_prefix="TORCHELASTIC_",
        install_fix="torchrun ships with torch: reinstall it in this environment (`make setup`)",
        command=f"{_CLI}.launch:torchrun_command", probe=f"{_CLI}.env_report:probe_torch",
        start="unified_dist.spawn:start_torch", source=f"{_DETECT}:torchrun"),
    BackendSpec(
        name="accelerate", backend_class="unified_dist.backends.accelerate_backend:AccelerateBackend",
        library="accelerate", launcher="accelerate", variable_prefix="ACCELERATE_",
        launcher_keys=("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU", "ACCELERATE_DYNAMO_BACKEND"),
        install_fix="install it with `pip install unified_dist[accelerate]` (or `make setup`)",
        command=f"{_CLI}.launch:accelerate_command", probe=f"{_CLI}.env_report:probe_accelerate",
        start="unified_dist.spawn:start_torch", source=f"{_DETECT}:accelerate"),
    BackendSpec(
        name="horovod", backend_class="unified_dist.backends.horovod_backend:HorovodBackend", library="horovod",
        launcher="horovodrun", launcher_keys=("HOROVOD_RANK", "HOROVOD_SIZE"), variable_prefix="HOROVOD_",
        install_fix=("build it against this torch with `make setup` "
                     "(tools/build_horovod.sh: horovod 0.28.1 patched to C++17)"),
        command=f"{_CLI}.launch:horovodrun_command", probe=f"{_CLI}.env_report:probe_horovod",
        start="unified_dist.spawn:start_horovod", source=f"{_DETECT}:horovodrun", sharding=False),
    BackendSpec(
        name="deepspeed", backend_class="unified_dist.backends.deepspeed_backend:DeepSpeedBackend",
        library="deepspeed", launcher="deepspeed", launcher_keys=("CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE"),
        install_fix=("install it with `make setup` (DS_BUILD_OPS=0 pip install --no-build-isolation "
                     "deepspeed==0.19.8, after torch)"),
        command=f"{_CLI}.launch:deepspeed_command", probe=f"{_CLI}.env_report:probe_deepspeed",
        start="unified_dist.spawn:start_torch", source=f"{_DETECT}:deepspeed",
        contract=False),  # its own launch tests (tests/launchers/test_deepspeed_engine.py): the engine's loop
    BackendSpec(
        name="single", backend_class="unified_dist.backends.single:SingleProcessBackend",
        probe=f"{_CLI}.env_report:probe_single"),
)}
"""Every backend, in the order users see them listed (``torch, accelerate, horovod, deepspeed, single``)."""

NAMES: Tuple[str, ...] = tuple(SPECS)
"""Every backend name ``init(backend=...)`` accepts."""

LAUNCHED: Tuple[str, ...] = tuple(name for name, spec in SPECS.items() if spec.launcher)
"""Backends with a multi-process launcher (``single`` is plain ``python script.py``)."""


def search_path(environ: Mapping[str, str] = os.environ) -> str:
    """``PATH`` with this interpreter's directory first, so launchers and ``python`` are this environment's."""
    own = os.path.dirname(sys.executable)
    rest = [p for p in environ.get("PATH", "").split(os.pathsep) if p and p != own]
    return os.pathsep.join([own, *rest])


def launcher_path(backend: str, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The path of ``backend``'s launcher on :func:`search_path` (where ``unified-dist launch`` finds it), or
    ``None`` (not installed, or a backend without a launcher)."""
    launcher = SPECS[backend].launcher
    return shutil.which(launcher, path=search_path(environ)) if launcher else None
