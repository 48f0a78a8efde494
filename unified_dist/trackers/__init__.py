"""Experiment trackers, written from the main process only: TensorBoard, MLflow, Weights & Biases,
trackio and a plain JSONL file.

    from unified_dist import trackers
    trackers.start(["tensorboard", "jsonl"], project_dir="runs/x", project_name="bert", config={"lr": 5e-5})
    trackers.log({"loss": 0.31}, step=10)        # every rank may call it; the main process writes
    trackers.get("tensorboard").tracker          # the library's own object (a SummaryWriter); None elsewhere
    trackers.finish()

The facade says the same in fewer words: ``ud.init(log_with="tensorboard", project_dir="runs/x")`` (or
``UNIFIED_DIST_LOG_WITH``, ``UNIFIED_DIST_PROJECT_DIR``), then ``ud.log(values, step)`` and
``ud.log_hparams(config)``; ``ud.shutdown()`` closes them (see ``docs/trackers.md``).

Why here and not in each script: every rank runs the same loop, and a tracker opened on every rank writes
N copies (N W&B runs, N event files that TensorBoard overlays). The rank that writes is decided once, here,
from the session's rank, under every launcher; the other ranks hold the same tracker objects, whose
``log`` and ``finish`` do nothing and whose ``tracker`` is ``None``.

Contract:

- ``log_with``: a name of :data:`NAMES`, a list of them, or ``"all"`` (every tracker whose library is
  installed; ``jsonl`` needs none). A library is imported only when its tracker starts; a missing one is
  a one-line :class:`TrackerNotInstalled` with the ``pip install`` line, raised on **every** rank (each
  checks for itself), so no rank waits for one that failed.
- ``log(values, step)``: ``values`` maps names to numbers (int, float, bool, a 0-d tensor or NumPy
  scalar, read as a Python number) or strings (TensorBoard text, an MLflow tag); anything else is a
  :class:`TrackerError` on every rank that calls, before anything is written. ``step=None`` is the last
  step logged + 1 (0 at first).
- Hyper-parameters (``config`` of :func:`start`, or :func:`log_hparams`): nested mappings are flattened
  to ``"outer.inner"`` names; a value that is not a bool, int, float or str (``None``, a list, ...) is
  written as its ``str``. TensorBoard keeps them in its HParams plugin, MLflow as parameters (strings),
  W&B and trackio in the run's config, JSONL in ``hparams.json``.
- Where each writes, under ``project_dir`` (default ``runs``): ``project_dir/project_name/`` holds
  TensorBoard's event files and the JSONL's ``metrics.jsonl`` and ``hparams.json``; MLflow a file store
  ``project_dir/mlruns`` (experiment ``project_name``; ``MLFLOW_TRACKING_URI`` wins), W&B an offline run
  in ``project_dir/wandb/`` (``WANDB_MODE`` or ``init_kwargs={"wandb": {"mode": ...}}`` win; ``wandb
  sync`` uploads it), trackio its local store in ``project_dir/trackio`` (``TRACKIO_DIR`` wins).
- ``init_kwargs`` maps a tracker's name to keywords for its library's own start call
  (``{"wandb": {"tags": ["a"]}}``, as Accelerate's ``init_trackers``).

Where things live: one module per tracker (``jsonl``, ``tensorboard``, ``mlflow``, ``wandb``, ``trackio``),
each a :class:`Tracker` subclass over :mod:`unified_dist.trackers.base` (the base class and the two errors);
this module holds the registry (:data:`KINDS`, name -> class) and the functions that start, feed and
finish the process's trackers.
"""
from __future__ import annotations

import atexit
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .. import session, settings
from ..errors import UnifiedDistError
from .base import Tracker, TrackerError, TrackerNotInstalled
from .jsonl import JsonlTracker
from .mlflow import MLflowTracker
from .tensorboard import TensorBoardTracker
from .trackio import TrackioTracker
from .wandb import WandBTracker

NAMES: Tuple[str, ...] = settings.TRACKER_NAMES
"""Every tracker's name, in the order ``"all"`` starts them."""

KINDS: Dict[str, type] = {cls.name: cls for cls in (JsonlTracker, TensorBoardTracker, MLflowTracker, WandBTracker,
                                                     TrackioTracker)}
"""Each tracker's class by its name, in :data:`NAMES` order."""
assert tuple(KINDS) == NAMES


# ---------------------------------------------------------------------- the process's trackers
_started: List[Tracker] = []
_last_step: Optional[int] = None
_chosen: Optional[Tuple[Optional[Tuple[str, ...]], str]] = None  # ud.init's (log_with, project_dir)
_exit_hook = False


def names(log_with: Union[str, Sequence[str], None]) -> List[str]:
    """The trackers ``log_with`` names, checked (a :class:`~unified_dist.errors.SettingError` for an
    unknown name); ``"all"`` is every installed one."""
    chosen = settings.TABLE["log_with"].from_code(log_with if log_with is not None else ())
    if chosen == ("all",):
        return [name for name in NAMES if KINDS[name].installed()]
    return list(chosen)


def start(log_with: Union[str, Sequence[str]], project_dir: Optional[str] = None, project_name: str = "",
          config: Optional[Mapping[str, Any]] = None,
          init_kwargs: Optional[Mapping[str, Mapping[str, Any]]] = None) -> List[Tracker]:
    """Start the trackers ``log_with`` names (see the module docstring) and return them, on every rank;
    each writes ``config``'s hyper-parameters. Every rank checks the names and the libraries, so a
    mistake is the same one-line error everywhere; only the main process opens anything.
    Refused while trackers are running: call :func:`finish` first."""
    global _last_step, _exit_hook
    if _started:
        raise TrackerError(f"trackers are already running ({', '.join(t.name for t in _started)}); "
                           "call finish() (ud.shutdown()) before starting others")
    chosen = names(log_with)
    unknown = sorted(set(init_kwargs or {}) - set(chosen))
    if unknown:
        raise TrackerError(f"init_kwargs names {', '.join(unknown)}, which log_with={log_with!r} does not start")
    for name in chosen:
        KINDS[name].require()
    flat = flatten(config or {})
    main = session.current_backend().rank == 0
    directory = project_dir if project_dir is not None else settings.TABLE["project_dir"].default
    for name in chosen:
        KINDS[name].prepare(directory)
    for name in chosen:
        _started.append(KINDS[name](directory, project_name, flat, (init_kwargs or {}).get(name, {}), main))
    _last_step = None
    if not _exit_hook:
        _exit_hook = True
        atexit.register(finish)
    return list(_started)


def log(values: Mapping[str, Any], step: Optional[int] = None) -> None:
    """Write ``values`` at ``step`` to every started tracker (main process only; nothing started:
    nothing written, as Accelerate's ``log``). ``step=None``: the last step + 1 (0 at first)."""
    global _last_step
    clean = checked(values)
    if step is None:
        step = 0 if _last_step is None else _last_step + 1
    elif isinstance(step, bool) or not isinstance(step, int):
        raise TrackerError(f"log(step={step!r}): a step is an int (the optimizer step), or None for the next one")
    _last_step = step
    for tracker in _started:
        tracker.log(clean, step)


def log_hparams(config: Mapping[str, Any]) -> None:
    """Write the hyper-parameters ``config`` (flattened, see the module docstring) to every started tracker."""
    flat = flatten(config)
    for tracker in _started:
        tracker.check_hparams()
    for tracker in _started:
        tracker.log_hparams(flat)


def get(name: str) -> Tracker:
    """The started tracker called ``name`` (on every rank; its ``tracker`` is ``None`` off the main process)."""
    for tracker in _started:
        if tracker.name == name:
            return tracker
    raise TrackerError(f"no {name!r} tracker is running; started: {', '.join(t.name for t in _started) or 'none'}")


def finish() -> None:
    """Close every started tracker (flushes event files, ends the MLflow and W&B runs); idempotent."""
    global _last_step
    running, _started[:] = list(_started), []
    _last_step = None
    for tracker in running:
        tracker.finish()


# ---------------------------------------------------------------------- what the facade chose
def choose(log_with: Any, project_dir: Optional[str]) -> None:
    """``ud.init``'s ``log_with`` and ``project_dir`` (``None``: not given), resolved as every setting
    (the keyword > its ``UNIFIED_DIST_*`` variable > the default). A second ``init`` that says
    otherwise is refused, as for every setting."""
    global _chosen
    given = {"log_with": log_with, "project_dir": project_dir}
    resolved = resolve_choice(log_with, project_dir)
    if _chosen is not None:
        for (name, value), running, wanted in zip(given.items(), _chosen, resolved):
            if value is not None and wanted != running:
                raise UnifiedDistError(
                    f"init() was already called with {name}={running!r}; call ud.init({name}={value!r}) before "
                    "any other ud function, or ud.shutdown() first")
        return
    _chosen = resolved  # type: ignore[assignment]


def resolve_choice(log_with: Any, project_dir: Optional[str]) -> Tuple[Any, ...]:
    """``(log_with, project_dir)`` as :func:`choose` resolves them; a value that does not read is a
    one-line :class:`~unified_dist.errors.SettingError` (``ud.init`` checks before it joins the group)."""
    return (settings.resolve("log_with", log_with, os.environ),
            settings.resolve("project_dir", project_dir, os.environ))


def from_settings() -> None:
    """Start the trackers ``ud.init`` (or the variables) chose, unless some are running: what
    ``ud.log`` and ``ud.log_hparams`` do first. Nothing chosen is a one-line :class:`TrackerError`."""
    if _started:
        return
    if _chosen is None:
        choose(None, None)
    log_with, project_dir = _chosen
    if log_with is None:
        raise TrackerError("ud.log has no tracker to write to: ud.init(log_with=\"tensorboard\") (or jsonl, mlflow, "
                           "wandb, trackio, all; or UNIFIED_DIST_LOG_WITH), or log_with=\"none\" to log nothing")
    start(log_with, project_dir)


def forget() -> None:
    """``ud.shutdown``: close the trackers and forget what ``init`` chose."""
    global _chosen
    finish()
    _chosen = None


# ---------------------------------------------------------------------- values
def checked(values: Mapping[str, Any]) -> Dict[str, Union[int, float, str]]:
    """``values`` with 0-d tensors and NumPy scalars read as Python numbers; a :class:`TrackerError`
    for a name that is not a string or a value that is neither a number nor a string."""
    if not isinstance(values, Mapping):
        raise TrackerError(f"log() takes a dict of name -> value, got {type(values).__name__}")
    clean = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise TrackerError(f"log() name {key!r} is a {type(key).__name__}; names are strings")
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # a 0-d tensor or a NumPy scalar
            value = value.item()
        if not isinstance(value, (int, float, str)):
            raise TrackerError(f"log() value {key!r} is a {type(value).__name__}; give a number (e.g. "
                               "loss.item()) or a string")
        clean[key] = value
    return clean


def flatten(config: Mapping[str, Any], prefix: str = "") -> Dict[str, Union[bool, int, float, str]]:
    """Hyper-parameters as one level of names: nested mappings as ``"outer.inner"``, values that are
    not bool, int, float or str as their ``str`` (an ``argparse.Namespace`` reads as its ``vars``)."""
    if hasattr(config, "__dict__") and not isinstance(config, Mapping):
        config = vars(config)
    if not isinstance(config, Mapping):
        raise TrackerError(f"hyper-parameters are a dict (or an argparse.Namespace), got {type(config).__name__}")
    flat: Dict[str, Union[bool, int, float, str]] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return flat


__all__ = ["NAMES", "Tracker", "TrackerNotInstalled", "TrackerError", "start", "log", "log_hparams", "get", "finish"]
