"""The processes an ``Accelerator`` trains with: the launcher's, whichever launcher that was.

Accelerate finds its peers only where ``accelerate launch`` or torchrun exported torch's ``env://``
variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), and on a machine without a GPU only when
asked for ``cpu=True``. Otherwise it quietly runs each process alone (``DistributedType.NO``), or
fails (mpirun: ``MASTER_ADDR expected``). :func:`join` runs before the real ``Accelerator`` is built:
it asks :func:`unified_dist.detection.detect` what started this process, with the ``accelerate``
backend chosen, which translates srun's, mpirun's and horovodrun's variables into a rendezvous
(under horovodrun a torch group of horovodrun's ranks, see
:func:`unified_dist.detection.stacks.torch_style_under_horovodrun`), exports them, and leaves the
rest to Accelerate itself: it then joins that group through its own code path.

The runner (``python -m unified_dist.accelerate``, ``unified-dist launch --accelerate-api``) calls
:func:`export_world` before the script runs, so that everything reaching Accelerate through a library
(transformers' ``TrainingArguments`` builds ``accelerate.state.PartialState`` before its ``Trainer``
builds an ``Accelerator``; TRL and PEFT go through those) and every script reading ``WORLD_SIZE`` or
``LOCAL_RANK`` itself sees the launcher's world.

Why not ``ud.init(backend="accelerate")``: that session builds an ``Accelerator`` of its own first,
and Accelerate's ``AcceleratorState`` keeps what its first ``Accelerator`` said (dynamo, FSDP and
DeepSpeed plugins, the parallelism config), so the user's arguments could be ignored silently; it also
installs stop-signal handlers that a plain Accelerate script does not have. Here the user's
``Accelerator`` is the first and only one. ``ud.*`` calls made afterwards adopt its group.
"""
from __future__ import annotations

import datetime
import os
import warnings
from typing import Optional

from ..backends.process_group import export_rendezvous, join_default_group, note_group_joined_elsewhere
from ..errors import LaunchError

LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                        "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")
"""Where a launcher says how many of its processes share this host (Accelerate sizes its CPU threads
by ``LOCAL_WORLD_SIZE``)."""


def launcher_world(environ=os.environ):
    """What started this process (a :class:`~unified_dist.detection.Detection`), with the
    ``accelerate`` backend chosen. Raises :class:`LaunchError` for a launch that cannot be joined."""
    from ..detection import detect
    from ..detection.stacks import accelerate_asks_for_deepspeed

    # under --use_deepspeed Accelerate itself runs DeepSpeed (on CPUs over gloo: see accelerator._over_gloo)
    found = detect(environ, "deepspeed" if accelerate_asks_for_deepspeed(environ) else "accelerate")
    if found.problems:
        raise LaunchError(found.problems[0])
    for message in found.warnings:
        warnings.warn(f"unified_dist.accelerate: {message}", UserWarning, stacklevel=4)
    return found


def export_world(found=None) -> int:
    """Export the launcher's world as the variables torch and Accelerate read (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_WORLD_SIZE``); returns its size.

    torchrun and ``accelerate launch`` exported them already (nothing changes); srun, mpirun and horovodrun
    export their own names only, so without this Accelerate's ``PartialState`` (built by ``Accelerator``,
    by transformers' ``TrainingArguments``, by TRL) runs each process alone (``DistributedType.NO``) or fails
    (``MASTER_ADDR expected``), and a script reading ``WORLD_SIZE`` or ``LOCAL_RANK`` itself (many Hugging
    Face scripts do) sees a world of one. Values already set are kept. Raises :class:`LaunchError` for a
    launch that cannot be joined (several launchers' variables that disagree, a world that cannot form).
    ``found``: :func:`launcher_world`'s answer where the caller already asked (detected once, warned once)."""
    found = found or launcher_world()
    if found.world_size <= 1:
        return 1
    if found.master_addr is not None:  # srun, mpirun, horovodrun: their variables are not torch's
        export_rendezvous(found)
    local = next((os.environ[k] for k in LOCAL_SIZE_VARIABLES if os.environ.get(k, "").isdigit()), None)
    if local is not None:
        os.environ.setdefault("LOCAL_WORLD_SIZE", local)
    return found.world_size


def join(timeout: Optional[datetime.timedelta] = None) -> int:
    """Make torch's ``env://`` describe the launcher's processes (:func:`export_world`), so that the
    ``Accelerator`` built next joins them; returns their number. Does nothing but count where a group (or
    Accelerate's state) already runs in this process, and refuses one that runs alone among several processes."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    found = launcher_world()
    _refuse_a_lonely_state(found.world_size)  # before anything is exported
    size = export_world(found)
    if size <= 1:
        return 1
    # a torchrun restart needs a per-attempt store (else Accelerate joins through torch's env:// itself)
    if not join_default_group(timeout or datetime.timedelta(minutes=30), always=False):
        note_group_joined_elsewhere()
    return size


def _refuse_a_lonely_state(world_size: int) -> None:
    """An Accelerate ``PartialState`` created before the first ``Accelerator`` (``get_logger``'s
    records, ``PartialState()``) on a launcher Accelerate does not read runs alone: refused."""
    import sys

    state = sys.modules.get("accelerate.state")
    if state is None or not state.PartialState._shared_state:
        return
    running = state.PartialState().num_processes
    if running != world_size:
        raise LaunchError(
            f"Accelerate's state was created before this Accelerator with {running} process(es), but the launcher "
            f"started {world_size}: create unified_dist.accelerate.Accelerator() before any PartialState() or "
            "Accelerate logging call")
