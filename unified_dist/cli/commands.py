"""What ``unified-dist launch`` builds and runs, shared by its two ways of running it.

A :class:`Plan` is what the user asked for, a :class:`Command` the native launcher line that honours it, and
:func:`environment` the variables it runs with. :mod:`unified_dist.cli.launch` builds commands for one launch and
:mod:`unified_dist.cli.replicas` runs one per replica group: both import this leaf module, and ``replicas``
never imports ``launch`` (``launch`` calls ``replicas`` for ``--replica-groups``), so the two form no import circle.
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Mapping, Optional, Tuple

from ..registry import search_path


@dataclass(frozen=True)
class Plan:
    """What the user asked for: a backend, a process layout, and the script with its arguments.

    ``nproc`` counts processes per node. ``master_addr``/``master_port`` are for torch and
    accelerate (accelerate also takes the port on one machine); ``hosts`` is horovod's
    ``host:slots,...`` list; ``settings`` maps setting names (``unified-dist launch``'s flags,
    :data:`unified_dist.settings.FLAGS`) to the values the script should run with; a setting left
    out (or ``None``) leaves the script's own choice alone.
    """

    backend: str
    script: str
    script_args: Tuple[str, ...] = ()
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    hosts: Optional[str] = None
    network_interface: Optional[str] = None
    settings: Mapping[str, Any] = field(default_factory=dict)

    def setting(self, name: str) -> Any:
        """The value asked for setting ``name``, or ``None``."""
        return self.settings.get(name)


@dataclass(frozen=True)
class Command:
    """A launcher command line plus the variables it is run with (shown in front of it);
    ``native`` names the settings its launcher carries with flags of its own."""

    argv: Tuple[str, ...]
    env: Dict[str, str] = field(default_factory=dict)
    native: FrozenSet[str] = frozenset()

    def line(self) -> str:
        """One shell line a user can copy: ``VAR=value ... launcher args``."""
        assignments = [f"{key}={shlex.quote(value)}" for key, value in self.env.items()]
        return " ".join([*assignments, shlex.join(self.argv)])


def environment(command: Command, base: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """The environment to run ``command`` in: ``base`` plus its variables, this interpreter's ``bin/`` first on PATH."""
    env = dict(base)
    env.update(command.env)
    env["PATH"] = search_path(base)
    return env
