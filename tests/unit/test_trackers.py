"""unified_dist.trackers and the facade's ud.log (docs/trackers.md), in one process: what each tracker wrote
is read back with its library's own reader (unified_dist/testing/tracker_files.py) and equals what was
logged, hyper-parameters included. Under the launchers (torchrun x2, horovodrun x2, ...) the contract
worker's trackers_write_from_the_main_process_only checks that only the main process writes."""
import importlib.util
import json
import os
import struct
import sys

import numpy
import pytest
import torch

import unified_dist as ud
from unified_dist import trackers
from unified_dist.errors import SettingError
from unified_dist.testing import tracker_files

CONFIG = {"lr": 5e-5, "model": "MiniLM", "layers": 6, "dropout_off": True,
          "optim": {"name": "adamw", "betas": [0.9, 0.99]}, "scheduler": None}
FLAT = {"lr": 5e-5, "model": "MiniLM", "layers": 6, "dropout_off": True, "optim.name": "adamw",
        "optim.betas": "[0.9, 0.99]", "scheduler": "None"}
LOGGED = [({"loss": 0.6931, "accuracy": torch.tensor(0.5), "lr": numpy.float64(1e-5)}, None),
          ({"loss": 0.25, "phase": "warm-up done"}, 10), ({"loss": 0.125}, None)]
EXPECTED = {"loss": [(0, 0.6931), (10, 0.25), (11, 0.125)], "accuracy": [(0, 0.5)], "lr": [(0, 1e-5)],
            "phase": [(10, "warm-up done")]}
"""What LOGGED must read back as: tensors and NumPy scalars as numbers, step None as the last step + 1."""


@pytest.fixture(autouse=True)
def _clean():
    yield
    trackers.finish()
    ud.shutdown()


def _log_all():
    for values, step in LOGGED:
        trackers.log(values, step=step)
    trackers.log_hparams({"extra": 3})


def _float32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def _needs(module):
    """Under CI=true every tracker library of requirements-ci.txt is installed: a missing one fails."""
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed (requirements-ci.txt pins it)")


def test_jsonl_reads_back_what_was_logged(tmp_path):
    trackers.start("jsonl", project_dir=str(tmp_path), project_name="run1", config=CONFIG)
    _log_all()
    assert trackers.get("jsonl").tracker.name == str(tmp_path / "run1" / "metrics.jsonl")
    trackers.finish()
    back = tracker_files.read_jsonl(str(tmp_path / "run1"))
    assert back == {"runs": 1, "metrics": EXPECTED, "hparams": {**FLAT, "extra": 3}}


def test_tensorboard_event_file_reads_back_what_was_logged(tmp_path):
    """Scalars come back as float32 (TensorBoard's format), strings as text, hyper-parameters from the
    HParams plugin (numbers as floats, as the plugin keeps them)."""
    _needs("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    trackers.start(["tensorboard"], project_dir=str(tmp_path), project_name="run1", config=CONFIG)
    assert isinstance(trackers.get("tensorboard").tracker, SummaryWriter)
    _log_all()
    trackers.finish()
    back = tracker_files.read_tensorboard(str(tmp_path / "run1"))
    expected = {k: [(s, v if isinstance(v, str) else _float32(v)) for s, v in rows] for k, rows in EXPECTED.items()}
    hparams = {k: v if isinstance(v, str) else float(v) for k, v in {**FLAT, "extra": 3}.items()}
    assert back == {"runs": 1, "metrics": expected, "hparams": hparams}


def test_mlflow_store_reads_back_what_was_logged(tmp_path, monkeypatch):
    """A local file store (no server): metrics with their steps, strings as tags, parameters as strings."""
    _needs("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    trackers.start("mlflow", project_dir=str(tmp_path), project_name="exp1", config=CONFIG)
    run_id = trackers.get("mlflow").tracker.info.run_id
    assert "MLFLOW_TRACKING_URI" not in os.environ  # MLflow exports it; a later start would take it for the user's
    _log_all()
    trackers.finish()
    back = tracker_files.read_mlflow(str(tmp_path), "exp1")
    metrics = {k: rows for k, rows in EXPECTED.items() if k != "phase"}
    assert back == {"runs": 1, "metrics": {**metrics, "phase": [(None, "warm-up done")]},
                    "hparams": {k: str(v) for k, v in {**FLAT, "extra": 3}.items()}}
    from mlflow.tracking import MlflowClient

    assert MlflowClient("file:" + str(tmp_path / "mlruns")).get_run(run_id).info.status == "FINISHED"
    # a second start in the same process with another project_dir writes there, not into the first store
    trackers.start("mlflow", project_dir=str(tmp_path / "second"), project_name="exp2", config={"lr": 0.5})
    trackers.log({"loss": 1.0}, step=0)
    trackers.finish()
    assert tracker_files.read_mlflow(str(tmp_path / "second"), "exp2") == {
        "runs": 1, "metrics": {"loss": [(0, 1.0)]}, "hparams": {"lr": "0.5"}}
    assert tracker_files.read_mlflow(str(tmp_path), "exp2")["runs"] == 0


def test_wandb_offline_run_reads_back_what_was_logged(tmp_path, monkeypatch):
    """Offline by default (no network, no account): the run's .wandb file holds the history and config.
    ``init_kwargs`` reach ``wandb.init``: here no system-metrics process beside W&B's own service (two
    processes at once would read as a launch to tests/conftest.py's watch)."""
    _needs("wandb")
    import wandb

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers.start("wandb", project_dir=str(tmp_path), project_name="proj", config=CONFIG,
                   init_kwargs={"wandb": {"settings": wandb.Settings(x_disable_stats=True)}})
    run = trackers.get("wandb").tracker
    assert run.offline and run.project == "proj"
    _log_all()
    trackers.finish()
    back = tracker_files.read_wandb(str(tmp_path))
    assert back == {"runs": 1, "metrics": EXPECTED, "hparams": {**FLAT, "extra": 3}}


def test_trackio_local_store_reads_back_what_was_logged(tmp_path, monkeypatch):
    """trackio's local SQLite store (no server, no Space): the values with their steps, and the
    hyper-parameters, including those of a log_hparams before the first log (trackio stores a run's
    config with its first log); after a log, log_hparams is refused in one line before any tracker writes;
    a second start with another project_dir in the same process is refused (trackio reads TRACKIO_DIR once)."""
    _needs("trackio")
    monkeypatch.delenv("TRACKIO_DIR", raising=False)
    monkeypatch.setattr(trackers.TrackioTracker, "chosen_dir", None)
    trackers.start(["trackio", "jsonl"], project_dir=str(tmp_path), project_name="proj", config=CONFIG)
    trackers.log_hparams({"extra": 3})
    for values, step in LOGGED:
        trackers.log(values, step=step)
    with pytest.raises(trackers.TrackerError, match="trackio stores a run's hyper-parameters with its first log"):
        trackers.log_hparams({"late": 1})
    trackers.finish()
    back = tracker_files.read_trackio(str(tmp_path / "trackio"), "proj")
    assert back == {"runs": 1, "metrics": EXPECTED, "hparams": {**FLAT, "extra": 3}}
    assert "late" not in tracker_files.read_jsonl(str(tmp_path / "proj"))["hparams"]  # nothing written anywhere
    with pytest.raises(trackers.TrackerError, match="trackio already stores this process's runs in"):
        trackers.start("trackio", project_dir=str(tmp_path / "other"), project_name="proj")
    trackers.start("trackio", project_dir=str(tmp_path), project_name="quiet", config={"lr": 0.5})
    trackers.finish()  # a run without logs keeps its hyper-parameters too
    assert tracker_files.read_trackio(str(tmp_path / "trackio"), "quiet")["hparams"] == {"lr": 0.5}
    assert "TRACKIO_DIR" not in os.environ  # ours only while a run is open: no later process takes it for the user's


@pytest.mark.parametrize("name,module,line", [("tensorboard", "tensorboard", "pip install tensorboard"),
                                              ("mlflow", "mlflow", "pip install mlflow-skinny"),
                                              ("wandb", "wandb", "pip install wandb"),
                                              ("trackio", "trackio", "pip install trackio")])
def test_a_missing_library_is_a_one_line_error_with_the_pip_line(name, module, line, monkeypatch, tmp_path):
    """A library that cannot be found (here each is installed, so it is hidden) stops start() before
    anything is written, in one line naming the install command."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == module else real(m, *a))
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(trackers.TrackerNotInstalled) as caught:
        trackers.start(["jsonl", name], project_dir=str(tmp_path))
    text = str(caught.value)
    assert f"`{line}`" in text and "\n" not in text and isinstance(caught.value, ImportError), text
    assert trackers._started == [] and not (tmp_path / "metrics.jsonl").exists()
    assert name not in trackers.names("all")


def test_all_is_every_installed_library():
    expected = ["jsonl"] + [n for n in ("tensorboard", "mlflow", "wandb", "trackio") if importlib.util.find_spec(n)]
    assert trackers.names("all") == expected
    assert trackers.names("TensorBoard, jsonl") == ["tensorboard", "jsonl"]


@pytest.mark.parametrize("call,words", [
    (lambda: trackers.start("tensorbord"), "unknown tracker 'tensorbord'"),
    (lambda: trackers.start("jsonl", init_kwargs={"wandb": {}}), "init_kwargs names wandb"),
    (lambda: trackers.log({"loss": [0.1, 0.2]}), "value 'loss' is a list"),
    (lambda: trackers.log({"loss": torch.ones(2)}), "value 'loss' is a Tensor"),
    (lambda: trackers.log({3: 0.1}), "name 3 is a int"),
    (lambda: trackers.log({"loss": 0.1}, step=1.5), "a step is an int"),
    (lambda: trackers.get("mlflow"), "no 'mlflow' tracker is running"),
])
def test_bad_input_is_a_one_line_error(call, words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises((trackers.TrackerError, SettingError)) as caught:
        call()
    assert words in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_other_ranks_hold_the_trackers_but_write_nothing(tmp_path):
    """What a rank other than 0 gets (its own process's view; the launches check the real thing)."""
    tracker = trackers.JsonlTracker(str(tmp_path), "p", {}, {}, main=False)
    tracker.log({"loss": 1.0}, 0)
    tracker.log_hparams({"lr": 1.0})
    tracker.finish()
    assert tracker.tracker is None and list(tmp_path.iterdir()) == []


def test_start_on_a_rank_other_than_0_opens_and_writes_nothing(tmp_path, monkeypatch):
    """start() asks the session which rank this is: anything but 0 holds inert trackers (the launches under
    torchrun and horovodrun check it with real ranks)."""
    import types

    monkeypatch.setattr(trackers.session, "current_backend", lambda: types.SimpleNamespace(rank=1))
    started = trackers.start(["jsonl", "tensorboard"], project_dir=str(tmp_path), config=CONFIG)
    _log_all()
    assert [t.tracker for t in started] == [None, None]
    trackers.finish()
    assert list(tmp_path.iterdir()) == []


def test_a_second_start_is_refused_until_finish(tmp_path):
    trackers.start("jsonl", project_dir=str(tmp_path))
    with pytest.raises(trackers.TrackerError, match="already running"):
        trackers.start("jsonl", project_dir=str(tmp_path))
    trackers.finish()
    trackers.finish()  # idempotent
    trackers.start("jsonl", project_dir=str(tmp_path))


# ---------------------------------------------------------------------- the facade
def test_facade_logs_to_the_trackers_init_chose_and_shutdown_closes_them(tmp_path):
    ud.init(backend="single", log_with="jsonl", project_dir=str(tmp_path))
    ud.log_hparams(CONFIG)
    for values, step in LOGGED:
        ud.log(values, step)
    handle = ud.tracker("jsonl").tracker
    ud.shutdown()
    assert handle.closed and trackers._started == []
    assert tracker_files.read_jsonl(str(tmp_path)) == {"runs": 1, "metrics": EXPECTED, "hparams": FLAT}


def test_the_variables_choose_the_trackers_without_a_line_of_code(tmp_path, monkeypatch):
    monkeypatch.setenv("UNIFIED_DIST_LOG_WITH", "jsonl")
    monkeypatch.setenv("UNIFIED_DIST_PROJECT_DIR", str(tmp_path / "from_env"))
    ud.log({"loss": 1.5})
    ud.shutdown()
    assert json.loads((tmp_path / "from_env" / "metrics.jsonl").read_text()) == {"step": 0, "loss": 1.5}


def test_facade_log_with_no_tracker_chosen_is_an_error_and_none_logs_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("UNIFIED_DIST_LOG_WITH", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(trackers.TrackerError, match="ud.log has no tracker to write to"):
        ud.log({"loss": 1.0})
    ud.shutdown()
    ud.init(backend="single", log_with="none")
    ud.log({"loss": 1.0})
    ud.log_hparams({"lr": 1.0})
    assert list(tmp_path.iterdir()) == []


def test_a_second_init_that_changes_the_trackers_is_refused(tmp_path):
    ud.init(backend="single", log_with=["jsonl"], project_dir=str(tmp_path))
    ud.init(backend="single")  # says nothing about trackers: fine
    with pytest.raises(ud.UnifiedDistError, match="already called with log_with"):
        ud.init(backend="single", log_with="tensorboard")
    ud.shutdown()
    with pytest.raises(SettingError, match="unknown tracker 'tensorbord'"):
        ud.init(backend="single", log_with="tensorbord")
    from unified_dist import session

    assert session._session is None  # refused before joining anything
