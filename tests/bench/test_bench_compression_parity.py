"""bench/compression/compression_parity.py's verdict, with the example's launches replaced by a stand-in that
writes the losses for the format its environment names (the real runs are the benchmark itself,
minutes per backend): the compressed run gets the format, a compressed run whose losses are the
float32 ones to within one float32 rounding step fails (compression did nothing), and so does one
past the 1e-4 tolerance."""
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from unified_dist.testing.launchers import bench_module

ROOT = Path(__file__).resolve().parents[2]
# the first 4 logged losses of bench/compression/results/compression_parity_smoke.json's torch row
FLOAT32 = [0.6932196617126465, 0.6910006999969482, 0.6925051808357239, 0.7032231092453003]
BF16 = [0.6932196617126465, 0.6910006999969482, 0.6925051212310791, 0.7032227516174316]


@pytest.fixture(scope="module")
def parity():
    return bench_module("bench/compression/compression_parity")


def _run(parity, monkeypatch, tmp_path, losses_for):
    """The bench's main() on torch and horovod, --short; ``losses_for(format)`` are what the stand-in
    logs for a run whose UNIFIED_DIST_GRADIENT_COMPRESSION is that format. Returns (exit status,
    the format each run got, the results' rows)."""
    formats = []

    def example(cmd, env, **kwargs):
        fmt = env["UNIFIED_DIST_GRADIENT_COMPRESSION"]
        formats.append(fmt)
        out = Path(cmd[cmd.index("--output-dir") + 1])
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text("".join(json.dumps({"type": "train", "step": step, "loss": loss}) + "\n"
                                                   for step, loss in enumerate(losses_for(fmt), 1)))
        (out / "results.json").write_text(json.dumps({"test_accuracy": 0.64, "wall_time_s": 1.0}))
        return subprocess.CompletedProcess(cmd, 0, stdout="")

    monkeypatch.setattr(parity, "subprocess", types.SimpleNamespace(run=example, PIPE=None, STDOUT=None))
    monkeypatch.setattr(parity, "launch_command", lambda backend, nproc, script, args: (["launch", script, *args], {}))
    out = tmp_path / "parity.json"
    monkeypatch.setattr(sys, "argv", ["compression_parity.py", "--short", "--backends", "torch,horovod",
                                      "--out", str(out)])
    status = parity.main()
    return status, formats, json.loads(out.read_text())["rows"]


def test_the_compressed_run_gets_the_format_and_its_rounding_passes(parity, monkeypatch, tmp_path):
    status, formats, rows = _run(parity, monkeypatch, tmp_path, lambda fmt: FLOAT32 if fmt == "none" else BF16)
    assert formats == ["none", "bf16", "none", "fp16"]  # horovod compresses with fp16
    assert [r["compression_changed_losses"] for r in rows] == [True, True]
    assert status == 0


def _one_float32_step_up(x):
    return torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(1.0)).item()


@pytest.mark.parametrize("compressed", [FLOAT32, [*FLOAT32[:3], _one_float32_step_up(FLOAT32[3])]],
                         ids=["identical", "one-float32-step"])
def test_losses_within_float32_rounding_of_the_float32_run_fail(parity, monkeypatch, tmp_path, compressed):
    status, _, rows = _run(parity, monkeypatch, tmp_path, lambda fmt: FLOAT32 if fmt == "none" else compressed)
    assert [r["compression_changed_losses"] for r in rows] == [False, False]
    assert status == 1


def test_losses_past_the_tolerance_fail(parity, monkeypatch, tmp_path):
    status, _, rows = _run(parity, monkeypatch, tmp_path,
                           lambda fmt: FLOAT32 if fmt == "none" else [loss * (1 + 2e-4) for loss in FLOAT32])
    assert [r["losses_within_tolerance"] for r in rows] == [False, False]
    assert status == 1
