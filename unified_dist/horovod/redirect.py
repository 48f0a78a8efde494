"""Run an unmodified ``import horovod.torch as hvd`` script on any launcher: a directory to put first on
``PYTHONPATH`` in which ``horovod.torch`` is :mod:`unified_dist.horovod`.

``unified-dist launch --horovod-api ...`` puts it there for the launched processes; by hand::

    PYTHONPATH=$(python -m unified_dist.horovod.redirect):$PYTHONPATH torchrun --nproc_per_node 2 train.py

Where the facade would run real Horovod (horovodrun with Horovod installed), the directory's ``horovod``
package steps aside and loads the real one, so ``horovodrun`` stays real Horovod. Every other
``horovod.*`` module (``horovod.common.exceptions``, ...) still comes from an installed Horovod.
"""
from __future__ import annotations

import os
from typing import Mapping

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shim")
"""The directory that holds the ``horovod`` package answering for ``horovod.torch``."""


def pythonpath(environ: Mapping[str, str] = os.environ) -> str:
    """``PYTHONPATH`` with :data:`SHIM_DIR` first (and unified_dist's own directory, so the shim finds it)."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parts = [SHIM_DIR, package_root] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))


if __name__ == "__main__":
    print(SHIM_DIR)
