"""Read back what :mod:`unified_dist.trackers` wrote, through each library's own reader (TensorBoard's
``EventAccumulator``, MLflow's client, W&B's record format), never through the trackers themselves:
what ``tests/test_trackers.py`` and the contract worker compare with the values they logged.

Each reader returns ``{"runs": n, "metrics": {name: [(step, value), ...]}, "hparams": {name: value}}``:
``runs`` counts the writers found (event files, MLflow runs, W&B run directories, JSONL files), which
is 1 when only the main process wrote.
"""
from __future__ import annotations

import glob
import json
import os
import struct
import time
from typing import Any, Dict, List, Tuple


def _result(runs: int, metrics: Dict[str, List[Tuple[int, Any]]], hparams: Dict[str, Any]) -> Dict[str, Any]:
    return {"runs": runs, "metrics": {k: sorted(v) for k, v in metrics.items()}, "hparams": hparams}


def read_jsonl(folder: str) -> Dict[str, Any]:
    """``metrics.jsonl`` and ``hparams.json`` in ``folder`` (project_dir/project_name)."""
    metrics: Dict[str, List[Tuple[int, Any]]] = {}
    files = glob.glob(os.path.join(folder, "metrics.jsonl"))
    for path in files:
        with open(path) as handle:
            for line in handle:
                row = json.loads(line)
                step = row.pop("step")
                for key, value in row.items():
                    metrics.setdefault(key, []).append((step, value))
    hparams_path = os.path.join(folder, "hparams.json")
    hparams = json.load(open(hparams_path)) if os.path.exists(hparams_path) else {}
    return _result(len(files), metrics, hparams)


def read_tensorboard(folder: str) -> Dict[str, Any]:
    """The event files in ``folder``: scalars (float32, as TensorBoard keeps them), text, and the
    HParams plugin's session-start hyper-parameters."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.util import tensor_util

    files = glob.glob(os.path.join(folder, "events.out.tfevents.*"))
    accumulator = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    metrics: Dict[str, List[Tuple[int, Any]]] = {}
    for tag in tags["scalars"]:
        metrics[tag] = [(e.step, e.value) for e in accumulator.Scalars(tag)]
    for tag in tags["tensors"]:
        if tag.endswith("/text_summary"):
            metrics[tag[: -len("/text_summary")]] = [
                (e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()) for e in accumulator.Tensors(tag)]
    hparams: Dict[str, Any] = {}
    for path in files:  # the last session start holds them all (the accumulator keeps the first)
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                if value.tag == "_hparams_/session_start_info":
                    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    hparams = {key: getattr(v, v.WhichOneof("kind"))
                               for key, v in data.session_start_info.hparams.items()}
    return _result(len(files), metrics, hparams)


def read_mlflow(project_dir: str, experiment: str) -> Dict[str, Any]:
    """The runs of ``experiment`` in the file store ``project_dir/mlruns``: the last run's metric
    histories, tags (as metrics at step None) and parameters (strings, as MLflow keeps them)."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when asked
    from mlflow.tracking import MlflowClient

    client = MlflowClient("file:" + os.path.abspath(os.path.join(project_dir, "mlruns")))
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found else []
    metrics: Dict[str, List[Tuple[int, Any]]] = {}
    hparams: Dict[str, Any] = {}
    if runs:
        run = runs[0]
        for key in run.data.metrics:
            metrics[key] = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        metrics.update({k: [(None, v)] for k, v in run.data.tags.items() if not k.startswith("mlflow.")})
        hparams = dict(run.data.params)
    return _result(len(runs), metrics, hparams)


def _wandb_records(path: str) -> List[bytes]:
    """The records of a ``.wandb`` file: a 7-byte header, then LevelDB-log blocks of 32 KiB whose
    chunks (7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last) make records."""
    raw = open(path, "rb").read()
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        pending += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def _wandb_run(path: str, wait_s: float) -> List[Any]:
    """The records of the run file ``path``, once its ``exit`` record is there: W&B's service process
    writes the file and may still be writing it for a moment after ``run.finish()`` returned."""
    from wandb.proto import wandb_internal_pb2

    deadline = time.time() + wait_s
    while True:
        records = []
        for data in _wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.time() > deadline:
            return records
        time.sleep(0.1)


def read_wandb(project_dir: str, wait_s: float = 30.0) -> Dict[str, Any]:
    """The offline W&B runs under ``project_dir/wandb``: the last run's history (at each record's step)
    and config, read from its ``.wandb`` file with W&B's own protobuf schema (waiting up to ``wait_s``
    for the service to finish writing it)."""
    files = sorted(glob.glob(os.path.join(project_dir, "wandb", "offline-run-*", "run-*.wandb")))
    metrics: Dict[str, List[Tuple[int, Any]]] = {}
    hparams: Dict[str, Any] = {}
    for record in _wandb_run(files[-1], wait_s) if files else []:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in row.items():
                if not key.startswith("_"):
                    metrics.setdefault(key, []).append((record.history.step.num, value))
        elif kind in ("run", "config"):
            update = record.run.config.update if kind == "run" else record.config.update
            hparams.update({item.key: json.loads(item.value_json) for item in update if not item.key.startswith("_")})
    hparams = {k: v["value"] if isinstance(v, dict) and set(v) <= {"value", "desc"} else v for k, v in hparams.items()}
    return _result(len(files), metrics, hparams)


def read_trackio(store: str, project: str) -> Dict[str, Any]:
    """trackio's local store ``store`` (``project_dir/trackio`` or ``TRACKIO_DIR``): the SQLite file of
    ``project``, read with ``sqlite3`` (its ``metrics`` rows: run, step, the values as JSON; its ``configs``
    rows: the run's hyper-parameters as JSON, trackio's own ``_`` keys left out)."""
    import sqlite3

    path = os.path.join(store, f"{project}.db")
    if not os.path.exists(path):
        return _result(0, {}, {})
    metrics: Dict[str, List[Tuple[int, Any]]] = {}
    hparams: Dict[str, Any] = {}
    with sqlite3.connect(path) as db:
        runs = {run for (run,) in db.execute("SELECT DISTINCT run_id FROM metrics")}
        for step, values in db.execute("SELECT step, metrics FROM metrics ORDER BY id"):
            for key, value in json.loads(values).items():
                metrics.setdefault(key, []).append((step, value))
        for (config,) in db.execute("SELECT config FROM configs ORDER BY id"):
            hparams.update({k: v for k, v in json.loads(config).items() if not k.startswith("_")})
    return _result(len(runs), metrics, hparams)
