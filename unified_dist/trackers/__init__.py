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
"""
from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import os
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .. import session, settings
from ..errors import BackendNotInstalled, UnifiedDistError

NAMES: Tuple[str, ...] = settings.TRACKER_NAMES
"""Every tracker's name, in the order ``"all"`` starts them."""


class TrackerNotInstalled(BackendNotInstalled):
    """A tracker's library cannot be imported; the message is the ``pip install`` line."""


class TrackerError(UnifiedDistError, ValueError):
    """A tracker was asked for something it cannot write, or trackers were used in the wrong order."""


# ---------------------------------------------------------------------- the trackers
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


class JsonlTracker(Tracker):
    """``metrics.jsonl`` (one line per :meth:`log`: ``{"step": s, **values}``) and ``hparams.json``;
    ``tracker`` is the open ``metrics.jsonl`` (its ``.name`` is the path)."""

    name = "jsonl"

    def open(self, config, kwargs):
        handle = open(os.path.join(self.folder, "metrics.jsonl"), "a", **kwargs)
        self.hparams: Dict[str, Any] = {}
        self.write_hparams_to = os.path.join(self.folder, "hparams.json")
        return handle

    def write(self, values, step):
        self.tracker.write(json.dumps({"step": step, **values}) + "\n")
        self.tracker.flush()

    def write_hparams(self, flat):
        self.hparams.update(flat)
        with open(self.write_hparams_to, "w") as handle:
            json.dump(self.hparams, handle, indent=1)

    def close(self, tracker):
        tracker.close()


class TensorBoardTracker(Tracker):
    """A ``torch.utils.tensorboard.SummaryWriter`` on ``project_dir/project_name`` (or init_kwargs'
    ``log_dir``): numbers as scalars, strings as text, hyper-parameters in the HParams plugin (in the same
    event file)."""

    name, module, install = "tensorboard", "tensorboard", "pip install tensorboard"

    def open(self, config, kwargs):
        from torch.utils.tensorboard import SummaryWriter

        kwargs.setdefault("log_dir", os.path.join(self.directory, self.project))  # init_kwargs may name another
        return SummaryWriter(**kwargs)

    def write(self, values, step):
        for key, value in values.items():
            if isinstance(value, str):
                self.tracker.add_text(key, value, step)
            else:
                self.tracker.add_scalar(key, value, step)
        self.tracker.flush()

    def write_hparams(self, flat):
        from torch.utils.tensorboard.summary import hparams

        self.hparams = {**getattr(self, "hparams", {}), **flat}  # TensorBoard shows one session's: all of them
        for summary in hparams(self.hparams, {}):  # experiment, session start, session end
            self.tracker.file_writer.add_summary(summary)
        self.tracker.flush()

    def close(self, tracker):
        tracker.close()


class MLflowTracker(Tracker):
    """An MLflow run (``tracker``: the ``mlflow.ActiveRun``) in experiment ``project_name``, in a local
    file store ``project_dir/mlruns`` unless ``MLFLOW_TRACKING_URI`` names another: numbers as metrics,
    strings as tags, hyper-parameters as parameters."""

    name, module, install = "mlflow", "mlflow", "pip install mlflow-skinny"

    def open(self, config, kwargs):
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 refuses a file store unless asked: a local store needs no server and no database
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            os.makedirs(self.directory, exist_ok=True)
            self.mlflow.set_tracking_uri("file:" + os.path.abspath(os.path.join(self.directory, "mlruns")))
        self.mlflow.set_experiment(self.project or "unified_dist")
        return self.mlflow.start_run(**kwargs)

    @property
    def mlflow(self) -> Any:
        return importlib.import_module("mlflow")

    def write(self, values, step):
        entities, now = self.mlflow.entities, int(time.time() * 1000)
        self.mlflow.MlflowClient().log_batch(
            self.tracker.info.run_id,
            metrics=[entities.Metric(k, float(v), now, step) for k, v in values.items() if not isinstance(v, str)],
            tags=[entities.RunTag(k, v) for k, v in values.items() if isinstance(v, str)])

    def write_hparams(self, flat):
        self.mlflow.MlflowClient().log_batch(
            self.tracker.info.run_id, params=[self.mlflow.entities.Param(k, str(v)) for k, v in flat.items()])

    def close(self, tracker):
        self.mlflow.MlflowClient().set_terminated(tracker.info.run_id)
        if self.mlflow.active_run() is not None and self.mlflow.active_run().info.run_id == tracker.info.run_id:
            self.mlflow.end_run()


class WandBTracker(Tracker):
    """A Weights & Biases run (``tracker``: the ``wandb.Run``) in ``project_dir/wandb/``, offline unless
    ``WANDB_MODE`` or ``init_kwargs={"wandb": {"mode": ...}}`` says otherwise."""

    name, module, install = "wandb", "wandb", "pip install wandb"
    config_at_open = True

    def open(self, config, kwargs):
        import wandb

        os.makedirs(self.directory, exist_ok=True)
        kwargs.setdefault("mode", os.environ.get("WANDB_MODE") or "offline")
        return wandb.init(project=self.project or "unified_dist", dir=os.path.abspath(self.directory),
                          config=config, **kwargs)

    def write(self, values, step):
        self.tracker.log(values, step=step)

    def write_hparams(self, flat):
        self.tracker.config.update(flat, allow_val_change=True)

    def close(self, tracker):
        tracker.finish()


class TrackioTracker(Tracker):
    """A trackio run (``tracker``: what ``trackio.init`` returns), stored locally in
    ``project_dir/trackio`` (a SQLite file per project) unless ``TRACKIO_DIR`` says otherwise.

    trackio reads ``TRACKIO_DIR`` once per process, when it is first imported: a later start with another
    ``project_dir`` is refused in one line rather than written into the first one's store."""

    name, module, install = "trackio", "trackio", "pip install trackio"
    config_at_open = True
    chosen_dir: Optional[str] = None
    """The store this module gave ``TRACKIO_DIR`` (``None``: the user's, or none yet)."""

    @classmethod
    def prepare(cls, directory: str) -> None:
        users = os.environ.get("TRACKIO_DIR") if os.environ.get("TRACKIO_DIR") != cls.chosen_dir else None
        target = os.path.abspath(users or os.path.join(directory, "trackio"))
        imported = sys.modules.get("trackio.utils")
        if imported is not None and os.path.abspath(str(imported.TRACKIO_DIR)) != target:
            raise TrackerError(
                f"trackio already stores this process's runs in {imported.TRACKIO_DIR} (it reads TRACKIO_DIR once, "
                f"at import), not {target}: give every run of the process the same project_dir")
        if users is None:
            os.environ["TRACKIO_DIR"] = TrackioTracker.chosen_dir = target

    def open(self, config, kwargs):
        import trackio

        return trackio.init(project=self.project or "unified_dist", config=config, **kwargs)

    logged = False
    """Whether values were logged (on every rank): trackio stores a run's config with its first log only."""

    def log(self, values, step):
        self.logged = True
        super().log(values, step)

    def check_hparams(self):
        if self.logged:
            raise TrackerError("trackio stores a run's hyper-parameters with its first log: pass them as config when "
                               "the trackers start, or log_hparams before the first log")

    def write(self, values, step):
        import trackio

        trackio.log(values, step=step)

    def write_hparams(self, flat):
        self.tracker.config.update(flat)  # carried by the first log

    def close(self, tracker):
        if tracker.config and not self.logged:  # no log carried the hyper-parameters: one empty log at step 0 does
            import trackio

            trackio.log({}, step=0)
        tracker.finish()


KINDS: Dict[str, type] = {cls.name: cls for cls in (JsonlTracker, TensorBoardTracker, MLflowTracker, WandBTracker,
                                                     TrackioTracker)}
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
