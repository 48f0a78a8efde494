"""``python -m unified_dist.accelerate script.py [args]``: run an Accelerate script with no line changed,
also one that reaches Accelerate through a library (transformers' ``Trainer``, TRL's trainers, PEFT).

Before the script runs, in this order:

1. the launcher's world is exported as the variables torch and Accelerate read (``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_WORLD_SIZE``;
   :func:`unified_dist.accelerate.world.export_world`): srun, mpirun and horovodrun export none of them;
2. ``accelerate.Accelerator`` (also as ``accelerate.accelerator.Accelerator``) becomes
   :class:`unified_dist.accelerate.Accelerator`, and ``accelerate.PartialState`` (also as
   ``accelerate.state.PartialState``, the name transformers' ``TrainingArguments`` and Accelerate's
   ``AcceleratorState`` use) :class:`unified_dist.accelerate.PartialState`: on a machine without CUDA
   several processes then form one gloo group (``MULTI_CPU``) even where nothing asked for ``cpu=True``.
   Modules imported before this point (Accelerate's own) keep Accelerate's classes; a state they create
   first with a world of one is refused when the first ``Accelerator`` is built.

Then ``script.py`` runs as ``__main__`` with its arguments. Any launcher can start it: ``torchrun
--nproc_per_node 2 -m unified_dist.accelerate script.py``, ``accelerate launch ... -m unified_dist.accelerate
script.py``, ``horovodrun -np 2 -H localhost:2 --gloo python -m unified_dist.accelerate script.py``,
``srun``/``mpirun ... python -m unified_dist.accelerate script.py``, or ``unified-dist launch
--accelerate-api``.
"""
from __future__ import annotations

import os
import runpy
import sys


def main(argv: list) -> None:
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m unified_dist.accelerate script.py [script arguments]")
    import accelerate
    import accelerate.accelerator
    import accelerate.state

    from . import world
    from .accelerator import Accelerator, PartialState

    world.export_world()
    accelerate.Accelerator = Accelerator  # what `from accelerate import Accelerator` now reads
    accelerate.accelerator.Accelerator = Accelerator  # and `from accelerate.accelerator import Accelerator`
    accelerate.PartialState = PartialState
    accelerate.state.PartialState = PartialState  # transformers, and AcceleratorState's own first state
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` would
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
