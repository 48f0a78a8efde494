"""Accelerate scripts on every launcher: change ``from accelerate import Accelerator`` to
``from unified_dist.accelerate import Accelerator``.

:class:`Accelerator` is Accelerate's own ``Accelerator`` (a subclass) whose processes are the
launcher's, whichever launcher that was (horovodrun, srun, mpirun, torchrun, ``accelerate launch``,
python). :class:`PartialState` is Accelerate's too, joined the same way when it is the process's first
state. Every other name of the ``accelerate`` package is forwarded unchanged (``DistributedType``,
``AcceleratorState``...), so a line importing several names can change its module only;
:mod:`unified_dist.accelerate.utils` and :mod:`unified_dist.accelerate.logging` do the same for
``accelerate.utils`` (``set_seed``) and ``accelerate.logging`` (``get_logger``).
``python -m unified_dist.accelerate script.py`` (or ``unified-dist launch --accelerate-api``) runs a script with
no line changed, also one that reaches Accelerate through transformers' ``Trainer``, TRL or PEFT: the
launcher's world is exported first (see ``__main__``).
See docs/accelerate-migration.md.
"""
from __future__ import annotations

from typing import Any

from .accelerator import Accelerator, PartialState


def __getattr__(name: str) -> Any:
    """Every other public name of ``accelerate`` (PEP 562): the same object."""
    import accelerate

    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(accelerate, name)


__all__ = ["Accelerator", "PartialState"]
