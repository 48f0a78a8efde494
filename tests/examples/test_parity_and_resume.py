"""A resumed run ends with the weights of the uninterrupted one, dropout on (issue 4).

With dropout, an exact resume needs every rank's RNG state besides the loader position, the
optimizer and the scheduler. Resuming across launchers and world sizes (dropout off) is
test_bert_sentiment.py's ring of launches; the N processes x b == 1 process x N*b arithmetic is the
contract suite's (test_contract_under_launchers.py).
"""
from __future__ import annotations

import json

import pytest
import torch
from runs_in_one_launch import launch_plan  # pytest puts this folder on sys.path

pytestmark = [pytest.mark.example, pytest.mark.distributed, pytest.mark.slow]
SCRIPT = "examples/bert_sentiment/train.py"
TINY = ["--limit-train", "96", "--limit-eval", "40", "--max-length", "32", "--log-every", "1", "--no-progress",
        "--no-plots", "--eval-batch-size", "16", "--threads", "1", "--eval-every", "0"]


def _metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _train_losses(path):
    return {r["step"]: r["loss"] for r in _metrics(path) if r["type"] == "train"}


def _final_weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "final_model" / "model.safetensors"))


def _runs(launcher, folder, runs, nproc=2, timeout=400) -> dict:
    """``runs`` (name, output folder, arguments) one after the other in one launch (tests/examples/
    runs_in_one_launch.py: the example's ``main()`` run by run in the same processes, each ``ud.init`` ..
    ``ud.shutdown``); each run's own part of the output, by name."""
    plan = [{"name": name, "argv": [*args, "--output-dir", str(out)]} for name, out, args in runs]
    result, parts = launch_plan(launcher, plan, folder, nproc, timeout)
    result.check()
    return parts


def test_resumed_run_ends_with_the_weights_of_the_uninterrupted_one(tmp_path, tiny_bert):
    """Dropout on: exact resume needs every rank's RNG state, the loader position and the optimizer.

    Two runs of one torchrun launch: the uninterrupted run saves step 3 on its way (the same state a run stopped
    there saves: ``--stop-after`` itself is exercised by test_bert_sentiment.py's ring), and the second run
    continues that checkpoint in a directory of its own to step 6. The processes' generators are wherever the
    first run left them when the second starts: only the checkpoint's RNG states give it the first run's dropout.
    """
    args = [*TINY, "--model", tiny_bert, "--max-steps", "6", "--batch-size", "8", "--save-every", "3"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    outputs = _runs("torchrun", tmp_path, [
        ("whole", whole, args),
        ("parts", parts, [*args, "--resume", str(whole / "checkpoints" / "checkpoint-000000003.pt")])])
    assert "checkpoint-000000003.pt: step 3" in outputs["parts"], outputs
    a, b = _train_losses(whole), _train_losses(parts)
    assert sorted(a) == list(range(1, 7)) and sorted(b) == [4, 5, 6], b
    for step in range(4, 7):
        assert abs(a[step] - b[step]) <= 1e-6 * abs(a[step]), (step, a[step], b[step])
    wa, wb = _final_weights(whole), _final_weights(parts)
    for name in wa:
        assert torch.allclose(wa[name], wb[name], atol=1e-6, rtol=0), name
    ea = [r for r in _metrics(whole) if r["type"] == "eval"][-1]
    eb = [r for r in _metrics(parts) if r["type"] == "eval"][-1]
    assert ea["accuracy"] == eb["accuracy"] and ea["macro_f1"] == eb["macro_f1"]


def test_a_resume_with_more_steps_takes_the_new_schedule_at_once(tmp_path, tiny_bert):
    """Stopped at step 2 of a 4-step run, continued as a 6-step run: step 3 already uses the 6-step
    schedule's rate (linear decay without warm-up: lr * (6 - 2) / 6), not the one the 4-step schedule
    left in the optimizer (lr * (4 - 2) / 4)."""
    args = [*TINY, "--model", tiny_bert, "--batch-size", "8", "--warmup-ratio", "0", "--lr", "1e-4"]
    out = tmp_path / "run"
    _runs("python", tmp_path, [("stopped", out, [*args, "--max-steps", "4", "--stop-after", "2"]),
                               ("continued", out, [*args, "--max-steps", "6", "--resume", "auto"])], nproc=1)
    rates = {r["step"]: r["lr"] for r in _metrics(out) if r["type"] == "train"}
    assert sorted(rates) == [1, 2, 3, 4, 5, 6]
    assert abs(rates[2] - 1e-4 * (4 - 1) / 4) <= 1e-15, rates  # the first run's schedule
    assert abs(rates[3] - 1e-4 * (6 - 2) / 6) <= 1e-15, rates
