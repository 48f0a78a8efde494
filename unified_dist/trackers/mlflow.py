"""The MLflow tracker: a run in a local file store (or ``MLFLOW_TRACKING_URI``'s); ``mlflow`` is imported when
the tracker first uses it (an absolute import: this module does not stand for the library)."""
from __future__ import annotations

import importlib
import os
import time
from typing import Any

from .base import Tracker


class MLflowTracker(Tracker):
    """An MLflow run (``tracker``: the ``mlflow.ActiveRun``) in experiment ``project_name``, in a local
    file store ``project_dir/mlruns`` unless ``MLFLOW_TRACKING_URI`` names another: numbers as metrics,
    strings as tags, hyper-parameters as parameters. The process's environment is left as it was (no
    ``MLFLOW_TRACKING_URI`` of ours for a later start or a child process to mistake for the user's)."""

    name, module, install = "mlflow", "mlflow", "pip install mlflow-skinny"

    def open(self, config, kwargs):
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 refuses a file store unless asked: a local store needs no server and no database
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            os.makedirs(self.directory, exist_ok=True)
            self.mlflow.set_tracking_uri("file:" + os.path.abspath(os.path.join(self.directory, "mlruns")))
            # set_tracking_uri also exports MLFLOW_TRACKING_URI: left there, it would read as the user's
            # store to this process's next start (another project_dir) and to every process started later
            os.environ.pop("MLFLOW_TRACKING_URI", None)
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
