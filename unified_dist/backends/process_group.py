"""torch.distributed plumbing shared by the torch and accelerate backends.

Gathering into one buffer (:func:`gather_stacked`), and joining the default process group
safely after a torchelastic restart (:func:`join_default_group`):

torchrun's *static* rendezvous (``--master_port`` without ``--rdzv_backend c10d``; also what
``accelerate launch --main_process_port`` uses on one machine) keeps one agent TCPStore for
every ``--max-restarts`` attempt, and torch's ``env://`` handler adds no per-attempt prefix
when it reuses the agent store. A restarted rank can then read the dead attempt's gloo
addresses and fail with ``Gloo connectFullMesh failed ... Connection refused``, over and over
until the restarts run out. On a restart we therefore join through a store whose keys are
prefixed with the attempt number; the first attempt and non-elastic launches use torch's
own ``env://`` path unchanged.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
from typing import TYPE_CHECKING, Dict, Mapping, Optional

if TYPE_CHECKING:
    from ..detection import Detection

import torch
import torch.distributed as dist

from ..compat import all_gather_into_tensor
from ..errors import LaunchError
from .base import Backend
from .ports import DEFAULT_MASTER_PORT, free_port

TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
"""torch.distributed's op for each of :data:`~unified_dist.backends.base.PRIMITIVE_OPS`."""

def gather_stacked(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape everywhere) stacked on a new dim 0, in one collective.

    Gathers into one contiguous buffer (gloo wants the concatenated layout), so a caller that
    wants the concatenation along dim 0 gets it as a view, without the ``cat`` of a list gather.
    """
    rows = tensor.reshape((1,) + tuple(tensor.shape)) if tensor.dim() == 0 else tensor
    out = rows.new_empty((world_size * rows.shape[0],) + tuple(rows.shape[1:]))
    all_gather_into_tensor(out, rows.contiguous())
    return out.view((world_size,) + tuple(tensor.shape))


_rounds = 0
"""Groups this process has joined on a port :func:`export_rendezvous` chose itself."""


def export_rendezvous(detection: "Detection") -> Dict[str, str]:
    """Give torch's ``env://`` the identity and rendezvous the launcher did not export itself.

    srun and mpirun set their own variables, not torch's; a plain process sets none. Values the
    environment already has (torchrun's, or a user's ``MASTER_ADDR``) are kept. Returns the variables
    it set, which :func:`withdraw_rendezvous` removes at shutdown (so a later ``init`` detects the
    launcher again). A port it chooses moves on by one with each group the process joins: after
    ``ud.shutdown()`` and ``ud.init()`` (which every rank does alike) no rank can reach the store of
    the group before on the old port, which hung a re-init about once in ten under mpirun.
    """
    global _rounds
    if detection.master_port is None and detection.world_size == 1:
        port = free_port()  # a group of one has no peer to agree with: not 29500, which another job may hold
    else:
        port = (detection.master_port or DEFAULT_MASTER_PORT) + _rounds
    values = {"RANK": detection.rank, "WORLD_SIZE": detection.world_size, "LOCAL_RANK": detection.local_rank or 0,
              # single-node default: rendezvous on loopback, never on a public interface
              "MASTER_ADDR": detection.master_addr or "127.0.0.1",
              "MASTER_PORT": port}
    exported = {key: str(value) for key, value in values.items() if key not in os.environ}
    os.environ.update(exported)
    if "MASTER_PORT" in exported:
        _rounds += 1
    return exported


def withdraw_rendezvous(exported: Mapping[str, str]) -> None:
    """Remove the variables :func:`export_rendezvous` set (those still holding its values)."""
    for key, value in exported.items():
        if os.environ.get(key) == value:
            del os.environ[key]


def put_back_environ(before: Mapping[str, Optional[str]]) -> None:
    """Give each variable of ``before`` the value it names again (``None``: unset it): what a backend, or the
    library it drives, wrote for its start goes back at its shutdown."""
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def host_names() -> list:
    """Every rank's host name, in rank order (one gather: every rank must call it)."""
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts


def local_rank_from_hosts() -> int:
    """This rank's index among the ranks on its host, from one gather of host names.

    For a group the process joined itself (``init_process_group`` in an ``mp.spawn`` worker),
    where no launcher said which ranks share a machine.
    """
    hosts = host_names()
    return hosts[:dist.get_rank()].count(hosts[dist.get_rank()])


def restart_count(environ=os.environ) -> int:
    """The torchelastic attempt number of this process (0 on the first attempt or off torchrun)."""
    try:
        return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def needs_attempt_store(environ=os.environ) -> bool:
    """True when this is a restarted worker that shares the agent's store with earlier attempts."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restart_count(environ) > 0


_joins = 0
"""Default groups this process joined through :func:`join_default_group` so far."""


def rejoins_agent_store(environ=os.environ) -> bool:
    """True when this process joins the default group again (``ud.shutdown()`` then ``ud.init()``)
    on torchrun's agent store: the keys the first group left there (torch names the default group
    the same each time) would pair this group's ranks with the last one's."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and _joins > 0


def attempt_store(timeout: datetime.timedelta, environ=os.environ) -> dist.Store:
    """A client of the agent's TCPStore whose keys are private to this restart attempt and to
    this process's n-th group in it."""
    store = dist.TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]),
                          int(environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"unified_dist/attempt_{restart_count(environ)}/group_{_joins}", store)


def note_group_joined_elsewhere() -> None:
    """Count a default group that Accelerate joined itself (through torch's ``env://``): a later group
    of this process must then also keep out of the keys it left in torchrun's agent store."""
    global _joins
    _joins += 1


def join_default_group(timeout: datetime.timedelta, *, always: bool) -> bool:
    """Initialise the default process group (nccl on GPU, gloo on CPU) from the launcher's env.

    With ``always=False`` it only acts where torch's own path would be unsafe (a restarted
    worker, see the module doc) and otherwise leaves initialisation to the caller (Accelerate).
    Returns whether it initialised the group.
    """
    global _joins
    if dist.is_initialized():
        return False
    safe_store = needs_attempt_store() or rejoins_agent_store()
    if not (always or safe_store):
        return False
    options: dict = {"backend": "gloo", "timeout": timeout}
    if torch.cuda.is_available():
        device = cuda_device_for_group(os.environ)
        torch.cuda.set_device(device)
        # device_id binds the group to this GPU (no guessing it from the rank, no warnings)
        options.update(backend="nccl", device_id=device)
    if safe_store:
        options.update(store=attempt_store(timeout), rank=int(os.environ["RANK"]),
                       world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(**options)
    _joins += 1
    return True


def cuda_device_for_group(environ) -> torch.device:
    """This process's GPU in an nccl group: :meth:`Backend.device_for` of ``LOCAL_RANK``
    (``cuda:(LOCAL_RANK % visible GPUs)``), the device the backend computes on.

    The modulo serves launchers that give each process its own ``CUDA_VISIBLE_DEVICES`` (one
    visible GPU, local rank 1). Raises :class:`LaunchError` when the host's processes
    (``LOCAL_WORLD_SIZE``) outnumber the GPUs and no ``CUDA_VISIBLE_DEVICES`` splits them:
    ranks would share a GPU, which NCCL refuses (and ``cuda:LOCAL_RANK`` would not exist).
    """
    count = torch.cuda.device_count()
    local_size = int(environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if local_size > count and "CUDA_VISIBLE_DEVICES" not in environ:
        raise LaunchError(
            f"{local_size} processes on this host but {count} visible GPU(s): NCCL needs one GPU per process; "
            f"start at most {count} per host (e.g. torchrun --nproc_per_node {count}), "
            "or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on CPU over gloo")
    return Backend.device_for(int(environ.get("LOCAL_RANK", "0") or 0))


def destroy_at_exit(owns_group: bool) -> None:
    """Destroy the default process group at a clean exit if this process created it.

    gloo's worker threads keep work objects (and the tensors in them) alive; left to interpreter
    finalization they take the GIL of a dying interpreter and the process dies of SIGABRT
    ("terminate called without an active exception") after all its Python code ran. Destroying the
    group from an ``atexit`` handler joins those threads first (pytorch/pytorch#179291 proposed the
    same inside torch). Local: it sends nothing, so a peer that already left cannot block it.

    Where DeepSpeed's communication was set up in this process (its engine, or Accelerate's and the Trainer's
    DeepSpeed path), the groups are destroyed through ``deepspeed.comm.destroy_process_group()``, which also
    drops the references DeepSpeed keeps in module globals (``deepspeed.utils.groups``' world and data-parallel
    groups): held there, a destroyed group lived on into finalization (a fresh run of c124a51: rank 1 of a
    horovodrun launch of Accelerate's DeepSpeed path died of that SIGABRT after its work).
    """
    if owns_group and dist.is_initialized():
        deepspeed_comm = sys.modules.get("deepspeed.comm.comm")  # imported by DeepSpeed, never here
        if deepspeed_comm is not None and getattr(deepspeed_comm, "cdb", None) is not None:
            deepspeed_comm.destroy_process_group()  # torch's, then DeepSpeed's own references
        else:
            dist.destroy_process_group()
