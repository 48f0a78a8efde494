"""Which launcher started this process, and therefore which backend drives it.

Pure: reads an environment mapping (and a description of what is already running in the
process, see :class:`Live`), imports no backend, has no side effects. The facade calls
:func:`detect` once, at ``init``; tests call it with hand-made mappings.

Order (first match wins), and why:

1. ``init(backend=...)`` -- the user said so in code.
2. ``UNIFIED_DIST_BACKEND`` -- the user said so in the environment (e.g. a job script).
3. A stack already running in this process (``hvd.init()``, an Accelerate ``PartialState`` or
   ``Accelerator``, or a ``torch.distributed`` process group from any init method) -- a live
   group is a fact, the environment only a hint: code that initialised its own group (e.g. in
   an ``mp.spawn`` worker with ``init_method="tcp://..."``) may have no launcher variables at all.
4. horovodrun (``HOROVOD_RANK``/``HOROVOD_SIZE``) -- only horovodrun (or ``mpirun`` driving
   Horovod) sets these, and a horovodrun job may itself be started from a shell that carries
   torchrun-, accelerate-, MPI- or SLURM-like variables, so the most specific launcher goes first.
4b. DeepSpeed's launcher (``RANK``/``WORLD_SIZE`` with ``CROSS_RANK``/``CROSS_SIZE``/``LOCAL_SIZE``) and
   ``accelerate launch --use_deepspeed`` (``ACCELERATE_USE_DEEPSPEED=true``) -- both ask for the DeepSpeed
   engine: before accelerate (whose variables the second carries) and torchrun (whose ``RANK`` both carry).
   A torch-style backend chosen in 1-2 under ``--use_deepspeed`` would train plain DDP: a ``problem``.
5. ``accelerate launch`` (``ACCELERATE_MIXED_PRECISION``/``ACCELERATE_USE_CPU``...) -- accelerate
   runs torch's elastic agent inside, so its workers *also* carry torchrun's variables
   (``TORCHELASTIC_RUN_ID``, ``RANK``, ``WORLD_SIZE``): it must be checked before torchrun.
6. torchrun (``TORCHELASTIC_RUN_ID``, or ``RANK`` + ``WORLD_SIZE`` set by any torch-style launcher,
   the legacy ``python -m torch.distributed.launch`` included). Before SLURM and MPI, since
   ``srun torchrun ...`` and ``mpirun torchrun ...`` carry both and torchrun's are the workers'.
7. Open MPI / MVAPICH ``mpirun`` (``OMPI_COMM_WORLD_*``, ``MV2_COMM_WORLD_*``) -- before SLURM,
   because an ``mpirun`` inside a SLURM allocation starts its daemons through ``srun`` and its
   ranks inherit that step's ``SLURM_PROCID`` (one per node, not per rank).
8. ``srun`` (a SLURM job step: ``SLURM_STEP_ID`` + ``SLURM_PROCID``) -- before plain PMI, which
   ``srun --mpi=pmi2`` also sets (to the same numbers, but without a local size).
9. MPICH / Intel MPI ``mpiexec`` (``PMI_RANK``/``PMI_SIZE``).
10. Nothing: one plain process (world size 1; every collective returns its input). Signs of a
    launch that this process cannot join (a SLURM batch script with several tasks but no
    ``srun``, half-set torchrun variables) are ``problems``: ``init`` refuses with the command.

A backend chosen in 1-2 that is not the launcher's own joins the launcher's processes where it can
(torch or Accelerate under horovodrun: a torch group of horovodrun's ranks; Horovod under a torch-style
launcher on one host: rank 0 runs Horovod's rendezvous) and is otherwise a ``problem``: never a silent
world of one (:func:`_cannot_join`).

srun and mpirun give torch-style backends (``torch`` by default, ``accelerate`` when asked for)
a rendezvous address and port (``master_addr``/``master_port``); see :mod:`unified_dist.detection.jobs`.
The sources of 4-6 live in :mod:`unified_dist.detection.stacks`, each named by its stack's record
(:data:`unified_dist.registry.SPECS`, ``source``); those of 7-9 in :mod:`unified_dist.detection.jobs`.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Optional

from ..registry import NAMES, SPECS
from ..settings import BACKEND_ENV as ENV_BACKEND, LAUNCHER_ENV as ENV_LAUNCHER, PREFIX
from . import jobs, stacks
from .jobs import DERIVED_PORTS, derived_port
from .result import Detection, DetectionError, Live

BACKENDS = NAMES
"""Every backend name ``init(backend=...)`` accepts (:data:`unified_dist.registry.SPECS`)."""

LAUNCHER_VARIABLE_PREFIXES = (*(s.variable_prefix for s in SPECS.values() if s.variable_prefix),
                              PREFIX, "SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_", "MPI_LOCAL")
"""Prefixes of the variables a launcher (or a job around this process) sets: what a new job started
from inside this one must not inherit."""
TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "GROUP_RANK", "ROLE_RANK")
"""torch's ``env://`` variables, set by torchrun and by unified_dist for srun/mpirun."""

_TORCH, _ACCELERATE, _DEEPSPEED = SPECS["torch"], SPECS["accelerate"], SPECS["deepspeed"]
_TORCH_STYLE = (_TORCH.name, _ACCELERATE.name, _DEEPSPEED.name)
"""Backends that run on torch's default process group: each joins the processes any of their launchers started."""
_ORDER = ("horovod", "deepspeed", "accelerate", "torch")
"""The stacks whose launchers are sources 4-6, in that order (see the module docstring)."""


def detect(env: Mapping[str, str], explicit: Optional[str] = None, live: Optional[Live] = None) -> Detection:
    """Decide the backend from ``explicit`` (``init(backend=...)``), ``env`` (``os.environ``) and
    ``live`` (a stack already running in this process, if any).

    Raises :class:`DetectionError` for an unknown backend name or unparsable variables.
    Never imports a backend library: whether the chosen one is installed is checked later.
    """
    if explicit is not None:
        return _choose(explicit, env, live, f"init(backend={explicit!r})")
    forced = env.get(ENV_BACKEND)
    if forced:
        return _choose(forced, env, live, f"{ENV_BACKEND}={forced}")
    return _found(env, live)


def _choose(name: str, env: Mapping[str, str], live: Optional[Live], why: str) -> Detection:
    name = name.strip().lower()
    if name not in BACKENDS:
        raise DetectionError(
            f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)} (or leave it unset to detect the launcher)")
    found = _found(env, live)
    issues = found.problems
    if stacks.accelerate_asks_for_deepspeed(env) and name != _DEEPSPEED.name and live is None:
        return Detection(name, found.launcher, why, world_size=found.world_size, rank=found.rank, problems=(
            f"{why} under accelerate launch --use_deepspeed would train without DeepSpeed (plain "
            f"{'DDP' if name in _TORCH_STYLE else name}); leave the backend unset (the deepspeed backend runs "
            "the DeepSpeed engine) or launch without --use_deepspeed",))
    if name == "single":
        if found.world_size > 1:
            issues += (f"{found.launcher} started {found.world_size} processes but {why} makes each one run "
                       "alone: every rank trains on its own and writes the same outputs",)
        return Detection("single", "python", f"{why}: one plain process", warnings=issues)
    if found.backend == name or (name in _TORCH_STYLE and found.backend in _TORCH_STYLE):
        return replace(found, backend=name, reason=f"{why} ({found.reason})", problems=(), warnings=issues)
    if found.world_size <= 1:  # one process, whatever started it: the chosen backend runs it alone
        return Detection(name, "python", why, warnings=issues)
    # another stack's launcher started several processes: join them, or refuse (never a world of one)
    joined = (stacks.torch_style_under_horovodrun(env, name, why) if name in _TORCH_STYLE
              else stacks.horovod_over(env, found, why))
    return joined or _cannot_join(name, found, why)


def _cannot_join(name: str, found: Detection, why: str) -> Detection:
    """``name`` was chosen where another stack's launcher started ``found.world_size`` processes that
    it cannot join: a problem (``init`` refuses), never a silent world of one."""
    n = found.world_size
    fix = (f"it joins another launcher's processes only on one host and before any group runs; launch with "
           f"`horovodrun -np {n} -H host1:slots,host2:slots --gloo python script.py`"
           if name == SPECS["horovod"].name else f"launch with `torchrun --nproc_per_node {n} script.py`")
    origin = f"{found.backend} already runs them" if found.adopt else f"started by {found.launcher}"
    return Detection(name, found.launcher, why, world_size=n, rank=found.rank, problems=(
        f"{why}: {SPECS[name].library} cannot join the {n} processes of this job ({origin}) and would run each "
        f"one alone; {fix}, or leave the backend unset ({found.backend} joins them)",))


def _found(env: Mapping[str, str], live: Optional[Live]) -> Detection:
    return _from_launcher(env) if live is None else _adopted(env, live)


def _from_launcher(env: Mapping[str, str]) -> Detection:
    """Sources 4-10 of the module doc, in that order."""
    sources = [SPECS[name].load("source") for name in _ORDER] + [jobs.own_mpi, jobs.slurm, jobs.pmi]
    for source in sources:
        found = source(env)
        if found is not None:
            return found
    return _nothing(env)


def _adopted(env: Mapping[str, str], live: Live) -> Detection:
    """The running stack as it is; the environment only names the launcher that started us."""
    backend = live.stack
    if backend == _TORCH.name and any(env.get(k) for k in _ACCELERATE.launcher_keys):
        backend = _ACCELERATE.name  # accelerate launch's workers: Accelerate adopts the same group
    launcher = _from_launcher(env).launcher
    return Detection(backend, launcher if launcher != "python" else "existing",
                     f"{live.stack} is already initialised in this process ({live.world_size} process(es)): using it",
                     world_size=live.world_size, rank=live.rank, local_rank=live.local_rank, adopt=True)


def _nothing(env: Mapping[str, str]) -> Detection:
    problems = tuple(p for p in (jobs.slurm_without_step(env), _half_set_torch_vars(env)) if p)
    return Detection("single", env.get(ENV_LAUNCHER) or "python", "no launcher variables: one plain process",
                     problems=problems[:1])


def _half_set_torch_vars(env: Mapping[str, str]) -> Optional[str]:
    """Name the torch launcher variables that are set without their partners, if any."""
    present = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if env.get(k)]
    if not present or ("RANK" in present and "WORLD_SIZE" in present):
        return None
    missing = [k for k in ("RANK", "WORLD_SIZE") if k not in present]
    return (f"{', '.join(present)} set but {', '.join(missing)} missing: a distributed launch "
            f"half-configured; start with torchrun, or unset {', '.join(present)}, "
            f"or set {ENV_BACKEND}=single to run one process anyway")


__all__ = ["BACKENDS", "DERIVED_PORTS", "Detection", "DetectionError", "ENV_BACKEND", "ENV_LAUNCHER",
           "LAUNCHER_VARIABLE_PREFIXES", "Live", "TORCH_VARIABLES", "derived_port", "detect"]
