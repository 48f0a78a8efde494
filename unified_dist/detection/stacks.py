"""The sources of :func:`unified_dist.detection.detect` that recognise a stack's own launcher:
horovodrun, DeepSpeed's launcher (and ``accelerate launch --use_deepspeed``), accelerate launch, torchrun
(each named by its record in :data:`unified_dist.registry.SPECS`,
``source``). Each takes the environment and returns a :class:`Detection`, or ``None`` when its
launcher did not start this process."""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Optional, Tuple

from ..registry import SPECS
from ..settings import LAUNCHER_ENV as ENV_LAUNCHER
from .jobs import derived_port, rendezvous
from .result import Detection, read_int as _int

_TORCH, _ACCELERATE, _HOROVOD, _DEEPSPEED = SPECS["torch"], SPECS["accelerate"], SPECS["horovod"], SPECS["deepspeed"]
_TORCH_KEYS = ("RANK", "WORLD_SIZE")


def _torch_style(env: Mapping[str, str], backend: str, launcher: str, reason: str) -> Detection:
    return Detection(
        backend, env.get(ENV_LAUNCHER) or launcher, reason,
        world_size=_int(env, "WORLD_SIZE", 1), rank=_int(env, "RANK", 0),
        local_rank=_int(env, "LOCAL_RANK", 0),
    )


def horovodrun(env: Mapping[str, str]) -> Optional[Detection]:
    if not any(env.get(k) for k in _HOROVOD.launcher_keys):
        return None
    return Detection(
        _HOROVOD.name, env.get(ENV_LAUNCHER) or _HOROVOD.launcher,
        "HOROVOD_RANK/HOROVOD_SIZE are set (started by horovodrun)",
        world_size=_int(env, "HOROVOD_SIZE", 1), rank=_int(env, "HOROVOD_RANK", 0),
        local_rank=_int(env, "HOROVOD_LOCAL_RANK", 0),
    )


def torch_style_under_horovodrun(env: Mapping[str, str], backend: str, why: str) -> Optional[Detection]:
    """``backend`` ("torch" or "accelerate") chosen in processes horovodrun started: they join one
    torch.distributed group of horovodrun's ranks, with a rendezvous of their own (horovodrun's is
    Horovod's HTTP store, not torch's): loopback on one host (``HOROVOD_LOCAL_SIZE`` equals
    ``HOROVOD_SIZE``), else ``MASTER_ADDR``; the port ``MASTER_PORT`` or one derived from horovodrun's
    rendezvous address and port, the same on every rank and different for each horovodrun job
    (see :func:`unified_dist.detection.jobs.rendezvous`). ``None`` when horovodrun did not start us."""
    found = horovodrun(env)
    if found is None:
        return None
    size = found.world_size
    one_host = _int(env, "HOROVOD_LOCAL_SIZE", 0) == size or _int(env, "HOROVOD_CROSS_SIZE", 0) == 1
    server = [env.get(k) for k in ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT")]
    job = f"horovodrun:{server[0]}:{server[1]}" if all(server) else None
    addr, port, problems = rendezvous(env, _HOROVOD.launcher, one_host, None, job, size)
    return replace(found, backend=backend, reason=f"{why} ({found.reason}; joined through torch.distributed)",
                   master_addr=addr, master_port=port, problems=problems)


def horovod_over(env: Mapping[str, str], found: Detection, why: str) -> Optional[Detection]:
    """``horovod`` chosen where a torch-style launcher (torchrun, accelerate launch, srun, mpirun,
    ``ud.launch``) started ``found``'s processes: on one host they join, rank 0 running Horovod's
    rendezvous server (:mod:`unified_dist.backends.horovod_rendezvous`); ``master_addr``/``master_port``
    name the torch store that tells the others its port: torchrun's agent store where there is one,
    else one rank 0 holds on a port derived from the launcher's rendezvous. ``None`` (``init`` refuses)
    for a running group, or processes on several hosts."""
    if found.backend not in (_TORCH.name, _ACCELERATE.name) or found.adopt:
        return None
    size = found.world_size
    local_sizes = [_int(env, k, 0) for k in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                                             "MV2_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")]
    if size not in local_sizes and env.get("SLURM_STEP_NUM_NODES") != "1":
        return None
    addr, port = env.get("MASTER_ADDR") or found.master_addr, _int(env, "MASTER_PORT", 0) or found.master_port
    if not (addr and port):
        return None
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        port = derived_port(f"horovod:{addr}:{port}")  # a store of our own, away from torch's group's port
    return replace(found, backend=_HOROVOD.name, reason=f"{why} ({found.reason}; joined through Horovod's rendezvous)",
                   master_addr=addr, master_port=port)  # the launcher's problems stay problems


def accelerate_asks_for_deepspeed(env: Mapping[str, str]) -> bool:
    """``accelerate launch --use_deepspeed`` (or a config file with ``distributed_type: DEEPSPEED``) started
    this process: Accelerate exports ``ACCELERATE_USE_DEEPSPEED=true`` to its workers."""
    return env.get("ACCELERATE_USE_DEEPSPEED", "").strip().lower() == "true"


def deepspeed(env: Mapping[str, str]) -> Optional[Detection]:
    """DeepSpeed's own launcher (``deepspeed --num_gpus N script.py``: ``RANK``/``WORLD_SIZE`` as torchrun, plus
    ``CROSS_RANK``/``CROSS_SIZE``/``LOCAL_SIZE``, which torchrun does not set, and no ``TORCHELASTIC_RUN_ID``), or
    ``accelerate launch --use_deepspeed``: both ask for the DeepSpeed engine, which the ``deepspeed`` backend runs."""
    if not all(env.get(k) for k in _TORCH_KEYS):
        return None
    if accelerate_asks_for_deepspeed(env):
        return _torch_style(env, _DEEPSPEED.name, _ACCELERATE.launcher,
                            "ACCELERATE_USE_DEEPSPEED=true (started by accelerate launch --use_deepspeed)")
    if all(env.get(k) for k in _DEEPSPEED.launcher_keys) and not env.get("TORCHELASTIC_RUN_ID"):
        return _torch_style(env, _DEEPSPEED.name, _DEEPSPEED.launcher,
                            "RANK/WORLD_SIZE with CROSS_RANK/CROSS_SIZE/LOCAL_SIZE are set (started by deepspeed)")
    return None


def accelerate(env: Mapping[str, str]) -> Optional[Detection]:
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


def torchrun(env: Mapping[str, str]) -> Optional[Detection]:
    if not (any(env.get(k) for k in _TORCH.launcher_keys) or all(env.get(k) for k in _TORCH_KEYS)):
        return None
    return _torch_style(env, _TORCH.name, _TORCH.launcher,
                        "TORCHELASTIC_RUN_ID or RANK/WORLD_SIZE are set (started by torchrun)")
