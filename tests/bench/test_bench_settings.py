"""bench/time_to_accuracy/time_to_accuracy.py compares like with like: the Trainer's TrainingArguments read back
as the example's own settings (issue 12 item 1: the Trainer once ran with weight decay 0 because
its weight_decay sat inside a comment)."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tta():
    return _module("time_to_accuracy", ROOT / "bench" / "time_to_accuracy" / "time_to_accuracy.py")


@pytest.fixture
def no_accelerate_state_left():
    """TrainingArguments sets up Accelerate's PartialState in this process: reset it afterwards, or
    later tests see a running Accelerate stack (unified_dist adopts live stacks)."""
    yield
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.mark.parametrize("nproc,seed,bf16", [(1, 0, False), (2, 1, False), (1, 2, True)])
def test_trainer_and_example_read_back_the_same_settings(tta, tmp_path, nproc, seed, bf16, no_accelerate_state_left):
    transformers = pytest.importorskip("transformers")
    train = _module("bert_sentiment_train", ROOT / "examples" / "bert_sentiment" / "train.py")
    cfg = dict(tta.COMMON, out=str(tmp_path), eval_every=16, group_by_length=False, seed=seed, bf16=bf16)
    steps = tta.COMMON["limit_train"] // tta.COMMON["batch_size"]
    trainer = tta.trainer_effective(transformers.TrainingArguments(**tta.trainer_arguments(cfg)), steps, cfg,
                                    tta.COMMON["limit_train"])
    extra = ("--mixed-precision", "bf16") if bf16 else ()
    args = vars(train.parse_args(tta.example_args(tmp_path, nproc, 16, extra, seed)))
    example = tta.example_effective({"args": args, "steps": steps,
                                     "global_batch": args["batch_size"] * nproc * args["grad_accum"]})
    assert trainer["weight_decay"] == 0.01 and trainer["max_grad_norm"] == 1.0 and trainer["warmup_steps"] == 13
    assert trainer["seed"] == example["seed"] == seed and trainer["bf16"] is example["bf16"] is bf16
    # the example groups by length by default; the Trainer's ablation does too
    assert tta.hyperparameter_differences(trainer, example, ablation=("group_by_length",)) == {}


def test_a_difference_is_reported(tta):
    a = {"lr": 1e-4, "weight_decay": 0.01, "bf16": False}
    assert tta.hyperparameter_differences(a, dict(a, weight_decay=0.0)) == {"weight_decay": (0.01, 0.0)}
    assert tta.hyperparameter_differences(a, dict(a, bf16=True), ablation=("bf16",)) == {}


def test_time_to_threshold_and_the_spread_over_seeds(tta):
    curve = [(10.0, 0.5), (20.0, 0.79), (30.0, 0.81), (40.0, 0.80)]
    assert tta.time_to(curve, 0.8) == 30.0 and tta.time_to(curve, 0.9) is None
    s = tta.spread([30.0, None, 50.0])
    assert (s["n"], s["of"], s["mean"], s["min"], s["max"]) == (2, 3, 40.0, 30.0, 50.0)
    assert s["std"] == pytest.approx(14.1421356)  # the sample standard deviation
    assert tta.spread([None])["mean"] is None


def test_every_configuration_is_checked_against_a_reference_of_the_same_precision(tta):
    configs = tta.plan(2)
    for name, (_, reference, _) in configs.items():
        assert reference in configs
        assert ("bf16" in name) == ("bf16" in reference), (name, reference)
