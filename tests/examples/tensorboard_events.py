"""Reading the example's TensorBoard event files back and checking them against metrics.jsonl
(shared by test_tensorboard.py and test_bert_sentiment.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest


def read_metrics(out: Path) -> List[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def read_tensorboard(out: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def check_against_metrics(out: Path, launcher: str, world_size: int) -> None:
    """Every scalar of the event files, step by step, against metrics.jsonl and results.json."""
    rows = read_metrics(out)
    train = [r for r in rows if r["type"] == "train"]
    validation = [r for r in rows if r["type"] == "eval" and r["split"] == "validation"]
    test = [r for r in rows if r["type"] == "eval" and r["split"] == "test"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in validation] == [4, 5] and [r["step"] for r in test] == [5]

    tb = read_tensorboard(out)
    expected = {"train/loss": (train, "loss"), "train/learning_rate": (train, "lr"),
                "train/samples_per_s": (train, "samples_per_s"), "validation/accuracy": (validation, "accuracy"),
                "validation/macro_f1": (validation, "macro_f1"), "test/accuracy": (test, "accuracy"),
                "test/macro_f1": (test, "macro_f1")}
    assert set(tb.Tags()["scalars"]) == set(expected)
    for tag, (source, key) in expected.items():
        events = tb.Scalars(tag)
        assert [e.step for e in events] == [r["step"] for r in source], tag  # once each, in order
        assert [e.value for e in events] == pytest.approx([r[key] for r in source], rel=1e-6), tag
    results = json.loads((out / "results.json").read_text())
    assert tb.Scalars("test/accuracy")[-1].value == pytest.approx(results["test_accuracy"], rel=1e-6)

    texts = [t.tensor_proto.string_val[0].decode() for t in tb.Tensors("launch/text_summary")]
    assert texts and all(f"launcher {launcher}" in t and f"world_size {world_size}" in t for t in texts), texts
