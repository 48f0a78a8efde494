"""The example's files written by two main processes at once: under ``unified-dist launch --replica-groups`` each
group's rank 0 is a main process, and both write the run's ``training_curves.png`` (and results.json and
final_model/, the same way) into one output folder at about the same time. Each replaces the file whole from a
temporary file of its own; with one temporary name for both, the second ``os.replace`` found the first had moved
it (FileNotFoundError: exit 1 of a healthy group, seen in tests/launchers/test_replica_groups_steps.py).

Two forked processes draw the same curves; both have written their temporary file before either replaces it (a
barrier in ``os.replace``), the interleaving that failed."""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "bert_sentiment"))
import plots  # noqa: E402

pytest.importorskip("matplotlib").use("Agg")
import matplotlib.pyplot  # noqa: E402,F401  (imported once here: the forked drawers inherit it)

pytestmark = pytest.mark.distributed  # two processes, forked here


def _draw(metrics: str, png: str, barrier, errors) -> None:
    real = os.replace

    def replace_after_the_other_wrote(src, dst):
        barrier.wait(timeout=60)
        real(src, dst)

    plots.os.replace = replace_after_the_other_wrote  # this forked process's module only
    try:
        plots.plot_curves(metrics, png)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        errors.put(f"{type(exc).__name__}: {exc}")
        errors.close()
        errors.join_thread()  # the report has left this process before it exits
        os._exit(1)
    os._exit(0)


def test_two_main_processes_drawing_the_curves_at_once_both_succeed(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"type": "train", "step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)))
    png = tmp_path / "training_curves.png"
    fork = multiprocessing.get_context("fork")
    barrier, errors = fork.Barrier(2), fork.Queue()
    drawers = [fork.Process(target=_draw, args=(str(metrics), str(png), barrier, errors)) for _ in range(2)]
    for p in drawers:
        p.start()
    for p in drawers:
        p.join(120)
    codes = [p.exitcode for p in drawers]
    reported = [errors.get(timeout=5) for code in codes if code != 0]
    assert codes == [0, 0], reported
    assert png.read_bytes().startswith(b"\x89PNG"), "not the drawn curves"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "training_curves.png"]  # no temporaries
