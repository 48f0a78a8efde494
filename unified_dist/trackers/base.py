"""What every tracker shares: :class:`Tracker` (one tracker on one rank; on the main process it opens its
library's run and writes, on the others it holds ``tracker = None`` and does nothing) and the two tracker
errors. A leaf: each tracker's module and the package's registry import it, it imports none of them.

A tracker's module defines one subclass: ``name`` (its word in ``log_with``), ``module`` and ``install``
(the library and its ``pip install`` line), and ``open``/``write``/``write_hparams``/``close``, which run
on the main process only and import the library there, never at module level."""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Dict, Mapping, Optional, Union

from ..errors import BackendNotInstalled, UnifiedDistError


class TrackerNotInstalled(BackendNotInstalled):
    """A tracker's library cannot be imported; the message is the ``pip install`` line."""


class TrackerError(UnifiedDistError, ValueError):
    """A tracker was asked for something it cannot write, or trackers were used in the wrong order."""


class Tracker:
    """One tracker on one rank: ``name``, and ``tracker``, the library's own object on the main process
    (``None`` on the others, where :meth:`log`, :meth:`log_hparams` and :meth:`finish` do nothing)."""

    name = "?"
    module: Optional[str] = None  # the library to import (None: the standard library is enough)
    install = ""  # the pip line that installs it
    config_at_open = False  # whether open() hands the hyper-parameters to the library's own start call

    def __init__(self, directory: str, project: str, config: Dict[str, Any], kwargs: Mapping[str, Any],
                 main: bool) -> None:
        self.tracker: Any = None
        self.directory, self.project = directory, project
        if main:
            self.tracker = self.open(config, dict(kwargs))
            if not self.config_at_open:
                self.log_hparams(config)

    @classmethod
    def installed(cls) -> bool:
        return cls.module is None or importlib.util.find_spec(cls.module) is not None

    @classmethod
    def require(cls) -> None:
        """Raise :class:`TrackerNotInstalled` (one line, the pip command) if the library is missing."""
        if not cls.installed():
            raise TrackerNotInstalled(f"the {cls.name} tracker needs the {cls.module} package: "
                                      f"`{cls.install}` (or leave {cls.name} out of log_with)")

    @classmethod
    def prepare(cls, directory: str) -> None:
        """On every rank, before anything opens: settle what the library reads from the environment
        (a mistake is then the same one-line error everywhere). Nothing by default."""

    def log(self, values: Dict[str, Union[int, float, str]], step: int) -> None:
        if self.tracker is not None:
            self.write(values, step)

    def check_hparams(self) -> None:
        """On every rank, before any tracker writes hyper-parameters: refuse what this one cannot store."""

    def log_hparams(self, flat: Dict[str, Union[bool, int, float, str]]) -> None:
        if self.tracker is not None and flat:
            self.write_hparams(flat)

    def finish(self) -> None:
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            self.close(tracker)

    # what each tracker does on the main process
    def open(self, config: Dict[str, Any], kwargs: Dict[str, Any]) -> Any:
        raise NotImplementedError

    def write(self, values: Dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def write_hparams(self, flat: Dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self, tracker: Any) -> None:
        raise NotImplementedError

    @property
    def folder(self) -> str:
        """``project_dir/project_name``, created."""
        path = os.path.join(self.directory, self.project)
        os.makedirs(path, exist_ok=True)
        return path
