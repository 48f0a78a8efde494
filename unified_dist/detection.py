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

srun and mpirun give torch-style backends (``torch`` by default, ``accelerate`` when asked for)
a rendezvous address and port (``master_addr``/``master_port``); see :func:`_slurm` and :func:`_mpi`.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence, Tuple

from . import hostlist
from .errors import UnifiedDistError
from .registry import NAMES, SPECS
from .settings import BACKEND_ENV as ENV_BACKEND, LAUNCHER_ENV as ENV_LAUNCHER, PREFIX, SLURM_ENV as ENV_SLURM

BACKENDS: Tuple[str, ...] = NAMES
"""Every backend name ``init(backend=...)`` accepts (:data:`unified_dist.registry.SPECS`)."""

LAUNCHER_VARIABLE_PREFIXES = (*(s.variable_prefix for s in SPECS.values() if s.variable_prefix),
                              PREFIX, "SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_", "MPI_LOCAL")
"""Prefixes of the variables a launcher (or a job around this process) sets: what a new job started
from inside this one must not inherit."""
TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "GROUP_RANK", "ROLE_RANK")
"""torch's ``env://`` variables, set by torchrun and by unified_dist for srun/mpirun."""

DERIVED_PORTS = (15000, 25000)
"""srun/mpirun without ``MASTER_PORT``: the port is ``15000 + crc32(job id) % 10000`` (below
Linux's ephemeral range 32768-60999, so it never collides with a connection's own port)."""

_TORCH, _ACCELERATE, _HOROVOD = SPECS["torch"], SPECS["accelerate"], SPECS["horovod"]
_TORCH_KEYS = ("RANK", "WORLD_SIZE")
_TORCH_STYLE = (_TORCH.name, _ACCELERATE.name)
# (launcher family, rank, size, local rank, local size, job id keys)
_MPI_FLAVOURS = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")),
    ("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
     "MV2_COMM_WORLD_LOCAL_SIZE", ("MPIRUN_ID", "MV2_MPIRUN_ID")),
    ("MPICH/Intel MPI (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
     ("PMI_KVSNAME", "I_MPI_HYDRA_JOBID")),
)


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

    ``backend`` is one of :data:`BACKENDS`; ``launcher`` names what started the process
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


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise DetectionError(f"environment variable {key}={value!r} is not an integer; unset it or fix the launcher") from None


def _first(env: Mapping[str, str], keys: Sequence[str]) -> Optional[str]:
    return next((env[k] for k in keys if env.get(k)), None)


def derived_port(job_key: str) -> int:
    """The rendezvous port every task of one job computes alike from its job id (see :data:`DERIVED_PORTS`)."""
    low, high = DERIVED_PORTS
    return low + zlib.crc32(job_key.encode()) % (high - low)


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
    if name == "single":
        if found.world_size > 1:
            issues += (f"{found.launcher} started {found.world_size} processes but {why} makes each one run "
                       "alone: every rank trains on its own and writes the same outputs",)
        return Detection("single", "python", f"{why}: one plain process", warnings=issues)
    if found.backend == name or (name in _TORCH_STYLE and found.backend in _TORCH_STYLE):
        return replace(found, backend=name, reason=f"{why} ({found.reason})", problems=(), warnings=issues)
    # horovod asked for where another launcher runs, a torch-style backend where horovod runs,
    # or any of them in a plain process
    return Detection(name, "python", why, warnings=issues)


def _found(env: Mapping[str, str], live: Optional[Live]) -> Detection:
    return _from_launcher(env) if live is None else _adopted(env, live)


def _from_launcher(env: Mapping[str, str]) -> Detection:
    """Sources 4-10 of the module doc, in that order."""
    for source in (_horovodrun, _accelerate, _torchrun, _own_mpi, _slurm, _pmi):
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


def _torch_style(env: Mapping[str, str], backend: str, launcher: str, reason: str) -> Detection:
    return Detection(
        backend, env.get(ENV_LAUNCHER) or launcher, reason,
        world_size=_int(env, "WORLD_SIZE", 1), rank=_int(env, "RANK", 0),
        local_rank=_int(env, "LOCAL_RANK", 0),
    )


def _horovodrun(env: Mapping[str, str]) -> Optional[Detection]:
    if not any(env.get(k) for k in _HOROVOD.launcher_keys):
        return None
    return Detection(
        _HOROVOD.name, env.get(ENV_LAUNCHER) or _HOROVOD.launcher,
        "HOROVOD_RANK/HOROVOD_SIZE are set (started by horovodrun)",
        world_size=_int(env, "HOROVOD_SIZE", 1), rank=_int(env, "HOROVOD_RANK", 0),
        local_rank=_int(env, "HOROVOD_LOCAL_RANK", 0),
    )


def _accelerate(env: Mapping[str, str]) -> Optional[Detection]:
    if not any(env.get(k) for k in _ACCELERATE.launcher_keys):
        return None
    if env.get("WORLD_SIZE") and env.get("RANK"):
        return _torch_style(env, _ACCELERATE.name, _ACCELERATE.launcher,
                            "ACCELERATE_* and RANK/WORLD_SIZE are set (started by accelerate launch)")
    problems: Tuple[str, ...] = ()
    if env.get("MASTER_PORT") or env.get("MASTER_ADDR"):
        problems = (
            "accelerate launch asked for several processes but started them without a distributed "
            "launcher, so each one runs alone (world size 1). On a CPU machine run: accelerate launch "
            "--multi_gpu --num_processes N --num_machines 1 --mixed_precision no --dynamo_backend no script.py",
        )
    return Detection(_ACCELERATE.name, _ACCELERATE.launcher,
                     "ACCELERATE_* is set without RANK/WORLD_SIZE (accelerate launch, one process)",
                     problems=problems)


def _torchrun(env: Mapping[str, str]) -> Optional[Detection]:
    if not (any(env.get(k) for k in _TORCH.launcher_keys) or all(env.get(k) for k in _TORCH_KEYS)):
        return None
    return _torch_style(env, _TORCH.name, _TORCH.launcher,
                        "TORCHELASTIC_RUN_ID or RANK/WORLD_SIZE are set (started by torchrun)")


def _rendezvous(env: Mapping[str, str], launcher: str, one_host: bool, first_host: Optional[str],
                job_key: Optional[str], size: int) -> Tuple[Optional[str], Optional[int], Tuple[str, ...]]:
    """(address, port, problems) of a launcher that exports no torch rendezvous of its own."""
    addr = env.get("MASTER_ADDR") or ("127.0.0.1" if one_host else first_host)
    if env.get("MASTER_PORT"):
        port: Optional[int] = _int(env, "MASTER_PORT", 0)
    else:
        port = derived_port(job_key) if job_key else (29500 if one_host else None)
    if addr and port:
        return addr, port, ()
    hint = ("mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=29500 ..." if launcher == "mpirun"
            else "export MASTER_ADDR=<first host> MASTER_PORT=29500 before srun")
    return None, None, (f"{launcher} started {size} processes on several hosts and the rendezvous is unknown "
                        f"(MASTER_ADDR/MASTER_PORT unset); set them: {hint}",)


def _mpi(env: Mapping[str, str], flavour: tuple) -> Optional[Detection]:
    family, rank_key, size_key, local_key, local_size_key, job_keys = flavour
    if not (env.get(rank_key) and env.get(size_key)):
        return None
    size, rank = _int(env, size_key, 1), _int(env, rank_key, 0)
    local = _int(env, local_key, -1) if env.get(local_key) else _int(env, "SLURM_LOCALID", -1)
    reason = f"{rank_key}/{size_key} are set (started by {family}'s mpirun/mpiexec)"
    if size <= 1:
        return Detection("single", "mpirun", reason + ", one process")
    one_host = _int(env, local_size_key, 0) == size
    job = _first(env, job_keys)
    addr, port, problems = _rendezvous(env, "mpirun", one_host, None, job and f"mpi:{job}", size)
    if local < 0:
        problems += (f"{family} gave no local rank ({local_key} unset); set LOCAL_RANK per process or "
                     "start the job with torchrun",)
    return Detection("torch", "mpirun", reason, world_size=size, rank=rank, local_rank=max(local, 0),
                     master_addr=addr, master_port=port, problems=problems)


def _own_mpi(env: Mapping[str, str]) -> Optional[Detection]:
    return _mpi(env, _MPI_FLAVOURS[0]) or _mpi(env, _MPI_FLAVOURS[1])


def _pmi(env: Mapping[str, str]) -> Optional[Detection]:
    return _mpi(env, _MPI_FLAVOURS[2])


def _slurm_tasks(env: Mapping[str, str]) -> int:
    return _int(env, "SLURM_STEP_NUM_TASKS", 0) or _int(env, "SLURM_NTASKS", 0) or _int(env, "SLURM_NPROCS", 1)


def _slurm(env: Mapping[str, str]) -> Optional[Detection]:
    in_step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    if not (in_step and env.get("SLURM_PROCID")) or env.get(ENV_SLURM, "1") == "0":
        return None
    size, rank = _slurm_tasks(env), _int(env, "SLURM_PROCID", 0)
    reason = "SLURM_STEP_ID/SLURM_PROCID are set (a task of srun)"
    if size <= 1:
        return Detection("single", "srun", reason + ", one task")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    try:
        hosts = hostlist.expand(nodes)
    except hostlist.HostListError as exc:
        raise DetectionError(f"{exc}; set MASTER_ADDR to the first host of the job") from None
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    addr, port, problems = _rendezvous(env, "srun", len(hosts) <= 1, hosts[0] if hosts else None,
                                       job and f"slurm:{job}.{in_step}", size)
    return Detection("torch", "srun", reason, world_size=size, rank=rank, local_rank=_int(env, "SLURM_LOCALID", 0),
                     master_addr=addr, master_port=port, problems=problems)


def _nothing(env: Mapping[str, str]) -> Detection:
    problems = tuple(p for p in (_slurm_without_step(env), _half_set_torch_vars(env)) if p)
    return Detection("single", env.get(ENV_LAUNCHER) or "python", "no launcher variables: one plain process",
                     problems=problems[:1])


def _slurm_without_step(env: Mapping[str, str]) -> Optional[str]:
    """A SLURM allocation of several tasks that did not start this process with srun (or SLURM is off)."""
    tasks = _slurm_tasks(env) if env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") else 1
    if tasks <= 1:
        return None
    if (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")) and env.get(ENV_SLURM) == "0":
        return (f"srun started {tasks} tasks but {ENV_SLURM}=0 turns SLURM detection off, so each would run "
                f"alone; unset {ENV_SLURM}, or run one task per node: srun --ntasks-per-node 1 torchrun ...")
    return (f"this SLURM job has {tasks} tasks but this process was not started by srun, so it would run "
            f"alone; start it with `srun python script.py`, or set {ENV_BACKEND}=single to run one process")


def _half_set_torch_vars(env: Mapping[str, str]) -> Optional[str]:
    """Name the torch launcher variables that are set without their partners, if any."""
    present = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if env.get(k)]
    if not present or ("RANK" in present and "WORLD_SIZE" in present):
        return None
    missing = [k for k in ("RANK", "WORLD_SIZE") if k not in present]
    return (f"{', '.join(present)} set but {', '.join(missing)} missing: a distributed launch "
            f"half-configured; start with torchrun, or unset {', '.join(present)}, "
            f"or set {ENV_BACKEND}=single to run one process anyway")
