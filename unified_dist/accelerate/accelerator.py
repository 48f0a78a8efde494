"""``unified_dist.accelerate.Accelerator``: Hugging Face Accelerate's own ``Accelerator``, joined to
whatever launcher started the process.

It *is* an ``accelerate.Accelerator`` (a subclass): ``prepare``, ``backward``, ``accumulate``,
``gather_for_metrics``, ``save_state``/``load_state`` and every other member run Accelerate's code
with the user's constructor arguments, so the numbers, the learning-rate schedule (Accelerate steps a
prepared scheduler once per process per optimizer step), the sampler seeds and the checkpoint folder
layout are Accelerate's by construction. What it adds happens before Accelerate builds its state
(:func:`unified_dist.accelerate.world.join`): under horovodrun, srun, mpirun, torchrun and
``accelerate launch`` alike the ``Accelerator`` sees the launcher's processes, never a world of one.
Experiment trackers go through :mod:`unified_dist.trackers` (one implementation for the facade and
this class).
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import inspect
import os
import weakref
from typing import Any, Optional

import accelerate
import torch

from ..detection.stacks import accelerate_asks_for_deepspeed
from ..errors import UnifiedDistError
from . import world

_PARAMETERS = inspect.signature(accelerate.Accelerator.__init__)
_LIVE: "weakref.WeakSet[Accelerator]" = weakref.WeakSet()
"""The Accelerators of this process (a script may build several, e.g. one per run), for :func:`_leave`."""
_exit_handler_registered = False
"""Whether :func:`leave_at_exit` registered :func:`_leave` (once per process)."""


class Accelerator(accelerate.Accelerator):
    """Accelerate's ``Accelerator`` with the same arguments, over the launcher's processes.

    Differences from ``accelerate.Accelerator`` (each tested, see docs/accelerate-migration.md):

    - several processes on a machine without CUDA train together over gloo (``cpu=True``), where
      Accelerate would run each alone unless told ``cpu=True``;
    - under horovodrun, srun and mpirun the processes form one torch group (Accelerate: alone, or
      ``MASTER_ADDR expected``);
    - ``log_with`` trackers are :mod:`unified_dist.trackers`' (``get_tracker(name)`` gives an object with
      ``.name`` and ``.tracker``, the library's own run object);
    - :meth:`join_uneven_inputs` joins over CPU processes too (Accelerate: GPUs only);
    - a DeepSpeed plugin (or ``accelerate launch --use_deepspeed``) on several processes without CUDA runs
      Accelerate's DeepSpeed path over gloo (Accelerate: a world of one there, or no DeepSpeed with ``cpu=True``),
      and one that Accelerate would still leave out (``cpu=True``) is refused (:class:`DeepSpeedLeftOutError`), as
      is a ``DummyOptim``/``DummyScheduler`` prepared without DeepSpeed (:meth:`prepare`).
    """

    _ud_joining_on_cpu = False
    """True only while :meth:`join_uneven_inputs` enters Accelerate's, over several CPU processes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _PARAMETERS.bind(self, *args, **kwargs)
        bound.apply_defaults()
        given = dict(bound.arguments)
        given.pop("self")
        size = world.join(_timeout(given.get("kwargs_handlers")))
        deepspeed = _asks_for_deepspeed(given)
        if size > 1 and not torch.cuda.is_available():
            if deepspeed:  # Accelerate's DeepSpeed path, told the backend it finds on GPUs only
                given["kwargs_handlers"] = _over_gloo(given.get("kwargs_handlers"))
            else:
                given["cpu"] = True  # without it Accelerate runs each of the processes alone (DistributedType.NO)
        self._ud_log_with = given.pop("log_with")
        self._ud_trackers_started = False
        super().__init__(**given)
        if deepspeed and self.distributed_type != accelerate.DistributedType.DEEPSPEED:
            raise DeepSpeedLeftOutError(
                f"Accelerator: a DeepSpeed plugin (or --use_deepspeed) was given, but Accelerate set up "
                f"{self.distributed_type} and would train without DeepSpeed: drop cpu=True (the processes run "
                "DeepSpeed's CPU engine over gloo here), or drop the DeepSpeed plugin")
        leave_at_exit()
        _LIVE.add(self)

    def prepare(self, *args: Any, device_placement: Optional[list] = None) -> Any:
        """Accelerate's ``prepare``. A ``DummyOptim`` or ``DummyScheduler`` (the stand-ins for a DeepSpeed config's
        ``optimizer`` and ``scheduler`` sections) where Accelerate set up no DeepSpeed is refused in one line
        (:class:`DeepSpeedLeftOutError`): Accelerate hands it back as it is, and nothing would build the optimizer
        (its ``step`` fails later, or never trains)."""
        if self.distributed_type != accelerate.DistributedType.DEEPSPEED:
            from accelerate.utils import DummyOptim, DummyScheduler

            dummy = next((type(a).__name__ for a in args if isinstance(a, (DummyOptim, DummyScheduler))), None)
            if dummy is not None:
                raise DeepSpeedLeftOutError(
                    f"Accelerator.prepare: {dummy} stands for a DeepSpeed config's optimizer or scheduler, but "
                    f"Accelerate set up {self.distributed_type} without DeepSpeed: launch with accelerate launch "
                    "--use_deepspeed --deepspeed_config_file ds_config.json, or give "
                    "Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))")
        return super().prepare(*args, device_placement=device_placement)

    @property
    def multi_device(self) -> bool:
        """Accelerate's answer (several GPUs, NPUs...), and ``True`` while :meth:`join_uneven_inputs` enters
        over several CPU processes."""
        return super().multi_device or self._ud_joining_on_cpu

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: Any, even_batches: Optional[bool] = None) -> Any:
        """Accelerate's ``join_uneven_inputs`` on every device: torch's ``Join`` over ``joinables`` (the prepared
        DDP models), the prepared map-style loaders' ``even_batches`` set to ``even_batches`` meanwhile; with
        uneven batches, a process that runs out shadows the others' gradient all-reduces until all are done.

        Accelerate's own does nothing over several CPU processes (``MULTI_CPU``) but warn "only supported for
        multi-GPU training": a process with fewer batches then leaves its loop while the others wait in their
        next gradient all-reduce until the group's timeout. torch's ``Join`` runs over gloo, so here Accelerate's
        code runs as on GPUs (it asks :attr:`multi_device` on entering, to choose ``Join`` or nothing)."""
        with contextlib.ExitStack() as joined:
            self._ud_joining_on_cpu = self.distributed_type == accelerate.DistributedType.MULTI_CPU
            try:
                joined.enter_context(super().join_uneven_inputs(joinables, even_batches=even_batches))
            finally:
                self._ud_joining_on_cpu = False
            yield

    # ------------------------------------------------------------------ trackers (unified_dist.trackers)
    def init_trackers(self, project_name: str, config: Optional[dict] = None,
                      init_kwargs: Optional[dict] = None) -> None:
        """Start the ``log_with`` trackers (Accelerate's names: ``"tensorboard"``, ``"wandb"``,
        ``"mlflow"``, ``"all"``...) through :func:`unified_dist.trackers.start`, with ``config`` as the
        run's hyper-parameters; the main process writes, the others keep nothing. Every process calls it."""
        if not self._ud_log_with:
            return
        from .. import trackers

        trackers.start(self._ud_log_with, project_dir=self.logging_dir, project_name=project_name,
                       config=config, init_kwargs=init_kwargs or {})
        self._ud_trackers_started = True

    def log(self, values: dict, step: Optional[int] = None, log_kwargs: Optional[dict] = None) -> None:
        """Log ``values`` at ``step`` to every started tracker, from the main process only."""
        if not self._ud_trackers_started:
            return
        if log_kwargs:
            raise UnifiedDistError("Accelerator.log(log_kwargs=...) is not supported by unified_dist's trackers; "
                                   "pass the values and step only")
        from .. import trackers

        trackers.log(values, step=step)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker ``name`` (``.name``, ``.tracker``), or with ``unwrap=True`` the library's
        own run object (``.tracker``)."""
        if not self._ud_trackers_started:
            raise UnifiedDistError(f"no tracker {name!r}: call accelerator.init_trackers(...) with "
                                   "Accelerator(log_with=...) first")
        from .. import trackers

        found = trackers.get(name)
        return found.tracker if unwrap else found

    def end_training(self) -> None:
        """Finish the trackers, then leave the process group (as Accelerate's ``end_training``)."""
        if self._ud_trackers_started:
            from .. import trackers

            trackers.finish()
            self._ud_trackers_started = False
        _leave(False)  # the DDP reducers go before the group they hold
        super().end_training()


class PartialState(accelerate.PartialState):
    """Accelerate's ``PartialState`` (a subclass: the same process-wide state), over the launcher's
    processes when it is the first state of the process: :func:`world.join` runs first, and on a machine
    without CUDA several processes get ``cpu=True`` (gloo, ``MULTI_CPU``), where Accelerate's own would
    run each process alone (``DistributedType.NO``: ``PartialState()`` reads no ``ACCELERATE_USE_CPU``).
    Scripts built on ``PartialState()`` (Accelerate's ``test_utils/scripts/test_ops.py``) thus get the
    launcher's world under horovodrun, srun, mpirun and torchrun alike."""

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        if not accelerate.PartialState._shared_state:  # the first state of this process
            size = world.join(kwargs.get("timeout"))
            if size > 1 and not torch.cuda.is_available():
                cpu = True  # a DeepSpeed plugin comes with the Accelerator, which takes its state to DeepSpeed's
            leave_at_exit()
        super().__init__(cpu, **kwargs)


def leave_at_exit() -> None:
    """Register :func:`_leave` (reducers, then the group) for a clean interpreter exit; once per process."""
    global _exit_handler_registered
    if not _exit_handler_registered:
        _exit_handler_registered = True
        atexit.register(_leave, True)


def _leave(destroy: bool) -> None:
    """Free the DDP reducers of every live Accelerator's prepared models (those models cannot train
    afterwards), and with ``destroy`` the default process group: at a clean interpreter exit, and
    (reducers only) in ``end_training`` before Accelerate destroys the group.

    A reducer keeps its process group alive past ``destroy_process_group``; left to interpreter
    finalization, gloo's threads then abort the process ("terminate called without an active
    exception", SIGABRT) after all its Python code ran: one torchrun job in three on a 2-core machine
    with torch 2.13. Local: it sends nothing, so a peer that already left cannot block it.
    """
    from ..backends.ddp_lifetime import release_reducers
    from ..backends.process_group import destroy_at_exit

    release_reducers([model for accelerator in list(_LIVE) for model in getattr(accelerator, "_models", ())])
    if destroy:
        destroy_at_exit(True)


class DeepSpeedLeftOutError(UnifiedDistError):
    """A DeepSpeed plugin was given to an ``Accelerator`` that Accelerate set up without DeepSpeed
    (``cpu=True``), or a ``DummyOptim``/``DummyScheduler`` was prepared there: refused rather than trained as plain
    DDP (or not at all)."""


def _asks_for_deepspeed(given: dict) -> bool:
    """Whether an ``Accelerator`` built with the arguments ``given`` runs DeepSpeed where Accelerate can: a
    plugin given, or ``ACCELERATE_USE_DEEPSPEED=true`` (``accelerate launch --use_deepspeed``; Accelerate then
    builds ``DeepSpeedPlugin()`` from the launcher's variables)."""
    return (given.get("deepspeed_plugin") is not None or given.get("deepspeed_plugins") is not None
            or accelerate_asks_for_deepspeed(os.environ))


def _over_gloo(handlers: Any) -> list:
    """``handlers`` with the process group's backend set to gloo (the user's ``InitProcessGroupKwargs`` kept
    otherwise, or a new one). On a machine without CUDA Accelerate's DeepSpeed path starts DeepSpeed's
    communication with no backend, then counts a world of one; told gloo (what DeepSpeed's CPU accelerator
    uses without oneCCL) it counts the launcher's processes and runs DeepSpeed's engine on the CPU."""
    import dataclasses

    handlers = list(handlers or ())
    for i, handler in enumerate(handlers):
        if isinstance(handler, accelerate.utils.InitProcessGroupKwargs):
            handlers[i] = dataclasses.replace(handler, backend="gloo")
            return handlers
    return [*handlers, accelerate.utils.InitProcessGroupKwargs(backend="gloo")]


def _timeout(handlers: Any) -> Optional[datetime.timedelta]:
    """The ``timeout`` of an ``InitProcessGroupKwargs`` among ``kwargs_handlers``, if any."""
    for handler in handlers or ():
        if isinstance(handler, accelerate.utils.InitProcessGroupKwargs) and handler.timeout is not None:
            return handler.timeout
    return None
