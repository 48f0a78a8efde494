"""``python -m unified_dist.accelerate script.py [args]``: run an Accelerate script with no line changed.

``accelerate.Accelerator`` (also as ``accelerate.accelerator.Accelerator``) and ``accelerate.PartialState``
(the names ``from accelerate import ...`` reads) are replaced by :class:`unified_dist.accelerate.Accelerator` and
:class:`unified_dist.accelerate.PartialState` for this process, then ``script.py`` runs as ``__main__``
with its arguments. (A script importing ``PartialState`` from ``accelerate.state`` gets Accelerate's own.)
Any launcher can start it: ``torchrun --nproc_per_node 2 -m unified_dist.accelerate
script.py``, ``horovodrun -np 2 -H localhost:2 --gloo python -m unified_dist.accelerate script.py``,
``srun``/``mpirun ... python -m unified_dist.accelerate script.py``.

Where the script joins torch's ``env://`` rendezvous itself before unified_dist exported one (Accelerate's
own ``accelerate.state.PartialState`` under mpirun, srun or horovodrun, which export none of torch's
variables), torch's ``MASTER_ADDR expected`` becomes one :class:`~unified_dist.errors.LaunchError` line
naming the fix (:func:`unified_dist.backends.process_group.rendezvous_errors`).
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

    from ..backends.process_group import rendezvous_errors
    from .accelerator import Accelerator, PartialState

    accelerate.Accelerator = Accelerator  # what `from accelerate import Accelerator` now reads
    accelerate.accelerator.Accelerator = Accelerator  # and `from accelerate.accelerator import Accelerator`
    accelerate.PartialState = PartialState
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` would
    with rendezvous_errors(_launcher(), argv[0]):
        runpy.run_path(argv[0], run_name="__main__")


def _launcher() -> str:
    """What started this process, read before the script runs (Accelerate's state exports torch's
    ``RANK``/``WORLD_SIZE`` before it fails, which would then read as torchrun)."""
    from ..detection import detect

    try:
        return detect(os.environ, "accelerate").launcher
    except Exception:  # noqa: BLE001 - an environment detection refuses is the script's to report
        return "the launcher"


if __name__ == "__main__":
    main(sys.argv[1:])
