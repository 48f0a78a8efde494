"""bench/time_to_accuracy.py compares like with like: the Trainer's TrainingArguments read back
as the example's own settings (issue 12 item 1: the Trainer once ran with weight decay 0 because
its weight_decay sat inside a comment)."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tta():
    return _module("time_to_accuracy", ROOT / "bench" / "time_to_accuracy.py")


@pytest.fixture
def no_accelerate_state_left():
    """TrainingArguments sets up Accelerate's PartialState in this process: reset it afterwards, or
    later tests see a running Accelerate stack (unified_dist adopts live stacks)."""
    yield
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.mark.parametrize("nproc", [1, 2])
def test_trainer_and_example_read_back_the_same_settings(tta, tmp_path, nproc, no_accelerate_state_left):
    transformers = pytest.importorskip("transformers")
    train = _module("bert_sentiment_train", ROOT / "examples" / "bert_sentiment" / "train.py")
    cfg = dict(tta.COMMON, out=str(tmp_path), eval_every=16, group_by_length=False)
    steps = tta.COMMON["limit_train"] // tta.COMMON["batch_size"]
    trainer = tta.trainer_effective(transformers.TrainingArguments(**tta.trainer_arguments(cfg)), steps, cfg,
                                    tta.COMMON["limit_train"])
    args = vars(train.parse_args(tta.example_args(tmp_path, nproc, 16)))
    example = tta.example_effective({"args": args, "steps": steps,
                                     "global_batch": args["batch_size"] * nproc * args["grad_accum"]})
    assert trainer["weight_decay"] == 0.01 and trainer["max_grad_norm"] == 1.0 and trainer["warmup_steps"] == 13
    # the example groups by length by default; the Trainer's ablation does too
    assert tta.hyperparameter_differences(trainer, example, ablation=("group_by_length",)) == {}


def test_a_difference_is_reported(tta):
    a = {"lr": 1e-4, "weight_decay": 0.01, "bf16": False}
    assert tta.hyperparameter_differences(a, dict(a, weight_decay=0.0)) == {"weight_decay": (0.01, 0.0)}
    assert tta.hyperparameter_differences(a, dict(a, bf16=True), ablation=("bf16",)) == {}
