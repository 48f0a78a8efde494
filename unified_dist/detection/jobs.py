"""The sources of :func:`unified_dist.detection.detect` for launchers that start processes but no
distributed stack: SLURM's ``srun`` and MPI's ``mpirun``/``mpiexec`` (Open MPI, MVAPICH, MPICH/Intel
MPI). They give a torch-style backend its world, its rank and a rendezvous address and port, which
they do not export themselves (:func:`rendezvous`, :data:`DERIVED_PORTS`)."""
from __future__ import annotations

import zlib
from typing import Mapping, Optional, Tuple

from ..settings import BACKEND_ENV as ENV_BACKEND, SLURM_ENV as ENV_SLURM, TABLE
from . import hostlist
from .result import Detection, DetectionError, first_set as _first, read_int as _int

DERIVED_PORTS = (15000, 25000)
"""srun/mpirun without ``MASTER_PORT``: the port is ``15000 + crc32(job id) % 10000`` (below
Linux's ephemeral range 32768-60999, so it never collides with a connection's own port)."""
# (launcher family, rank, size, local rank, local size, job id keys)
_MPI_FLAVOURS = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")),
    ("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
     "MV2_COMM_WORLD_LOCAL_SIZE", ("MPIRUN_ID", "MV2_MPIRUN_ID")),
    ("MPICH/Intel MPI (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
     ("PMI_KVSNAME", "I_MPI_HYDRA_JOBID")),
)


def derived_port(job_key: str) -> int:
    """The rendezvous port every task of one job computes alike from its job id (see :data:`DERIVED_PORTS`)."""
    low, high = DERIVED_PORTS
    return low + zlib.crc32(job_key.encode()) % (high - low)


def rendezvous(env: Mapping[str, str], launcher: str, one_host: bool, first_host: Optional[str],
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
            else f"export MASTER_ADDR=<first host> MASTER_PORT=29500 before {launcher}")
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
    addr, port, problems = rendezvous(env, "mpirun", one_host, None, job and f"mpi:{job}", size)
    if local < 0:
        problems += (f"{family} gave no local rank ({local_key} unset); set LOCAL_RANK per process or "
                     "start the job with torchrun",)
    return Detection("torch", "mpirun", reason, world_size=size, rank=rank, local_rank=max(local, 0),
                     master_addr=addr, master_port=port, problems=problems)


def own_mpi(env: Mapping[str, str]) -> Optional[Detection]:
    return _mpi(env, _MPI_FLAVOURS[0]) or _mpi(env, _MPI_FLAVOURS[1])


def pmi(env: Mapping[str, str]) -> Optional[Detection]:
    return _mpi(env, _MPI_FLAVOURS[2])


def slurm_tasks(env: Mapping[str, str]) -> int:
    return _int(env, "SLURM_STEP_NUM_TASKS", 0) or _int(env, "SLURM_NTASKS", 0) or _int(env, "SLURM_NPROCS", 1)


def slurm(env: Mapping[str, str]) -> Optional[Detection]:
    in_step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    if not (in_step and env.get("SLURM_PROCID")) or not slurm_on(env):
        return None
    size, rank = slurm_tasks(env), _int(env, "SLURM_PROCID", 0)
    reason = "SLURM_STEP_ID/SLURM_PROCID are set (a task of srun)"
    if size <= 1:
        return Detection("single", "srun", reason + ", one task")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    try:
        hosts = hostlist.expand(nodes)
    except hostlist.HostListError as exc:
        raise DetectionError(f"{exc}; set MASTER_ADDR to the first host of the job") from None
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    addr, port, problems = rendezvous(env, "srun", len(hosts) <= 1, hosts[0] if hosts else None,
                                       job and f"slurm:{job}.{in_step}", size)
    return Detection("torch", "srun", reason, world_size=size, rank=rank, local_rank=_int(env, "SLURM_LOCALID", 0),
                     master_addr=addr, master_port=port, problems=problems)


def slurm_on(env: Mapping[str, str]) -> bool:
    """``UNIFIED_DIST_SLURM`` (on unless turned off; a value that is neither is a SettingError)."""
    return TABLE["slurm"].from_environment(env)


def slurm_without_step(env: Mapping[str, str]) -> Optional[str]:
    """A SLURM allocation of several tasks that did not start this process with srun (or SLURM is off)."""
    tasks = slurm_tasks(env) if env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") else 1
    if tasks <= 1:
        return None
    if (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")) and not slurm_on(env):
        return (f"srun started {tasks} tasks but {ENV_SLURM}={env.get(ENV_SLURM)} turns SLURM detection off, "
                "so each would run "
                f"alone; unset {ENV_SLURM}, or run one task per node: srun --ntasks-per-node 1 torchrun ...")
    return (f"this SLURM job has {tasks} tasks but this process was not started by srun, so it would run "
            f"alone; start it with `srun python script.py`, or set {ENV_BACKEND}=single to run one process")
