"""Same numbers under every world size and across an interruption (issue 4); the same numbers
under every launcher at one world size are test_bert_sentiment.py's test_losses_agree_across_launchers.

Uses the parity tool (python -m unified_dist.parity) on examples/bert_sentiment/train.py with
tiny settings. Global batch 16 everywhere: 2 processes x 8, 1 process x 16, 1 process x 8 x 2
accumulation steps.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch

from launchers import ROOT, child_env, free_port, run

SCRIPT = "examples/bert_sentiment/train.py"
TINY = ["--limit-train", "96", "--limit-eval", "40", "--max-length", "32", "--log-every", "1", "--no-progress",
        "--eval-batch-size", "16", "--threads", "1"]


def parity(tmp_path, runs, rtol, script_args, eval_atol=0.0, timeout=900):
    cmd = [sys.executable, "-m", "unified_dist.parity", SCRIPT, "--out", str(tmp_path), "--rtol", str(rtol),
           "--eval-atol", str(eval_atol), "--timeout", "400"]
    for r in runs:
        cmd += ["--run", r]
    return run([*cmd, "--", *script_args], timeout=timeout, env=child_env())


def test_same_losses_for_any_world_size_at_the_same_global_batch(tmp_path):
    result = parity(tmp_path, ["single16=python:1 --batch-size 16", "torch2x8=torch:2 --batch-size 8",
                               "accum2x8=python:1 --batch-size 8 --grad-accum 2"], 1e-4,
                    [*TINY, "--no-dropout", "--max-steps", "5"], eval_atol=0.05)
    assert result.returncode == 0, result.output[-4000:]


def _metrics(path):
    return [json.loads(l) for l in (path / "metrics.jsonl").read_text().splitlines() if l.strip()]


def _train_losses(path):
    return {r["step"]: r["loss"] for r in _metrics(path) if r["type"] == "train"}


def _final_weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "final_model" / "model.safetensors"))


def _launch(launcher, out, args, nproc=2, timeout=400):
    from launchers import launch

    return launch(launcher, SCRIPT, [*args, "--output-dir", str(out)], nproc=nproc, timeout=timeout).check()


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate", "horovodrun"])
def test_stopped_and_resumed_run_ends_with_the_same_weights(launcher, tmp_path):
    """Dropout on: exact resume needs every rank's RNG state, the loader position and the optimizer."""
    args = [*TINY, "--max-steps", "6", "--batch-size", "8", "--save-every", "3"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _launch(launcher, whole, args)
    _launch(launcher, parts, [*args, "--stop-after", "3"])
    _launch(launcher, parts, [*args, "--resume", "auto"])
    a, b = _train_losses(whole), _train_losses(parts)
    assert sorted(b) == list(range(1, 7)), b
    for step in range(1, 7):
        assert abs(a[step] - b[step]) <= 1e-6 * abs(a[step]), (step, a[step], b[step])
    wa, wb = _final_weights(whole), _final_weights(parts)
    for name in wa:
        assert torch.allclose(wa[name], wb[name], atol=1e-6, rtol=0), name
    ea = [r for r in _metrics(whole) if r["type"] == "eval"][-1]
    eb = [r for r in _metrics(parts) if r["type"] == "eval"][-1]
    assert ea["accuracy"] == eb["accuracy"] and ea["macro_f1"] == eb["macro_f1"]


def test_horovod_checkpoint_resumes_under_every_other_launcher(tmp_path):
    """Written under horovodrun -np 2, continued under torchrun, accelerate launch and plain python
    (world size 1 keeps the global batch by accumulation): the same losses as the uninterrupted run."""
    args = [*TINY, "--no-dropout", "--max-steps", "6", "--save-every", "3"]
    whole = tmp_path / "whole"
    _launch("horovodrun", whole, [*args, "--batch-size", "8"])
    reference = _train_losses(whole)
    written = tmp_path / "written"
    _launch("horovodrun", written, [*args, "--batch-size", "8", "--stop-after", "3"])
    checkpoint = sorted((written / "checkpoints").glob("*.pt"))[-1]
    for launcher, nproc, extra in (("torchrun", 2, ["--batch-size", "8"]),
                                   ("accelerate", 2, ["--batch-size", "8"]),
                                   ("python", 1, ["--batch-size", "8", "--grad-accum", "2"])):
        out = tmp_path / f"continued_{launcher}"
        _launch(launcher, out, [*args, *extra, "--resume", str(checkpoint)], nproc=nproc)
        losses = _train_losses(out)
        assert sorted(losses) == [4, 5, 6], (launcher, losses)
        for step, loss in losses.items():
            assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step]), (launcher, step, loss, reference[step])
