"""examples/minimal/train.py, the porting guide, unchanged under python, torchrun, accelerate launch
and horovodrun (4 launches, about a minute on 2 busy cores).

What must hold is arithmetic, not "it ran": data-parallel SGD with 2 processes x 16 examples takes
the steps one process takes with 32, because the union of a step's two shards is the single
process's batch (unified_dist's sharding) and the two gradients are averaged. So every launch ends
with the single-process weights. Only the order of float32 sums differs: 1.5e-8 here; the bound,
1e-6, still catches one wrong step (it moves a weight by about lr x gradient, ~1e-3). And the
single process must really have learned the toy problem: the weights within 0.05 of the true
linspace(-1, 1, 8), the mean squared error near the noise floor (0.1^2).

The horovodrun case is skipped with its reason under UNIFIED_DIST_WITHOUT_HOROVOD=1 (tests/conftest.py).
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Dict

import pytest
import torch

from unified_dist.testing.launchers import ROOT, launch, unavailable

pytestmark = [pytest.mark.example, pytest.mark.distributed, pytest.mark.slow]
SCRIPT = str(ROOT / "examples" / "minimal" / "train.py")
TIMEOUT = 120  # seconds per launch; the whole process group is killed after it
STEPS = 40
FINAL = re.compile(r"final mse ([0-9.]+) on (\d+) examples after (\d+) steps")


def _train(launcher: str, nproc: int, batch_size: int, out: Path) -> Dict:
    """Launch the example; return its one summary line's numbers and its checkpoint."""
    result = launch(launcher, SCRIPT, ["--steps", str(STEPS), "--batch-size", str(batch_size), "--output-dir",
                                       str(out)], nproc=nproc, timeout=TIMEOUT).check()
    finals = FINAL.findall(result.output)
    assert len(finals) == 1, result.output[-3000:]  # ud.print: the main process only
    mse, examples, steps = finals[0]
    assert (int(examples), int(steps)) == (512, STEPS)  # gather_for_metrics: every example once
    checkpoint = out / "checkpoints" / f"checkpoint-{STEPS:09d}.pt"  # ud.save_checkpoint's name
    return {"mse": float(mse), "model": torch.load(checkpoint, weights_only=True)["model"]}


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Dict:
    """The reference: one process, batch 32."""
    return _train("python", 1, 32, tmp_path_factory.mktemp("python"))


def test_single_process_learns_the_true_weights(single: Dict) -> None:
    weight, bias = single["model"]["weight"][0], single["model"]["bias"][0]
    assert (weight - torch.linspace(-1, 1, 8)).abs().max() < 0.05 and abs(bias) < 0.05, single["model"]
    assert 0.005 < single["mse"] < 0.02, single["mse"]


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate", "horovodrun"])
def test_two_processes_end_with_the_single_process_weights(launcher: str, single: Dict, tmp_path: Path) -> None:
    module = {"accelerate": "accelerate", "horovodrun": "horovod"}.get(launcher)
    if module and importlib.util.find_spec(module) is None:
        unavailable(f"{module} is not installed (make setup)")
    two = _train(launcher, 2, 16, tmp_path)
    for name, reference in single["model"].items():
        assert torch.allclose(two["model"][name], reference, rtol=0, atol=1e-6), (launcher, name)
    assert two["mse"] == pytest.approx(single["mse"], abs=2e-6)  # printed with 6 decimals


@pytest.mark.parametrize("readme", ["examples/minimal/README.md", "README.md"])
def test_the_readme_diff_is_the_diff_of_the_two_scripts(readme: str) -> None:
    """examples/minimal/README.md and the repository's README show `diff -u train_ddp.py train.py`: it must
    be that diff, line for line."""
    import subprocess

    here = ROOT / "examples" / "minimal"
    done = subprocess.run(["diff", "-u", "train_ddp.py", "train.py"], cwd=here, capture_output=True, text=True)
    real = done.stdout.splitlines()[2:]  # the two header lines carry dates
    text = (ROOT / readme).read_text()
    shown = text[text.index("```diff\n") + 8:].split("```", 1)[0].splitlines()
    assert shown[:2] == ["--- train_ddp.py", "+++ train.py"] and shown[2:] == real
    if readme.startswith("examples"):
        lines = len((here / "train.py").read_text().splitlines())
        assert f"`train.py` ({lines} lines)" in text


LONG = 300  # optimizer steps of the stopped run; the signal lands after step 100 on any machine (see below)
PAUSE = str(ROOT / "tests" / "examples" / "pause_before_ask.py")
STEP_LINE = re.compile(r"^step (\d+): loss", re.M)


def test_sigterm_to_torchrun_stops_saves_and_the_relaunch_on_one_process_ends_with_the_uninterrupted_weights(
        tmp_path: Path) -> None:
    """docs/preemption.md with the porting guide's few lines: SIGTERM to torchrun mid-run (torchrun forwards it
    to both workers; each worker, paused by pause_before_ask.py before its 100th ud.should_stop(), goes on once
    it has recorded the signal, so the signal lands after step 100 whatever the machine's speed) -> both stop
    at step 101 and the checkpoint of that step is written (torchrun itself then
ends with its SignalException, not with the workers' status);
    `python train.py` (1 process, batch 32: the same global batches) resumes it and ends with the weights of
    an uninterrupted 1-process run (float32 summation order: 1e-6, as above)."""
    import signal
    import subprocess
    import time

    from unified_dist.testing.launchers import child_env, command, kill_session

    out = tmp_path / "stopped"
    marker = tmp_path / "asking"
    argv = command("torchrun", PAUSE, [str(marker), "100", SCRIPT, "--steps", str(LONG), "--batch-size", "16",
                                       "--output-dir", str(out)])
    log = tmp_path / "stopped.log"
    with open(log, "w") as handle:
        proc = subprocess.Popen(argv, cwd=ROOT, env=child_env(), stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT  # a failure's bound, not a pace: the workers wait for the signal
        ready = [Path(f"{marker}.rank{r}") for r in (0, 1)]
        while proc.poll() is None and time.monotonic() < deadline and not all(p.exists() for p in ready):
            time.sleep(0.02)
        if all(p.exists() for p in ready):
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            kill_session(proc.pid)
    output = log.read_text()
    assert proc.returncode != 0, output[-3000:]  # torchrun was told to stop: it does not report success
    saved = sorted((out / "checkpoints").glob("checkpoint-*.pt"))
    assert len(saved) == 1, output[-3000:]
    stopped = int(saved[0].stem.split("-")[1])
    assert stopped == 101, stopped  # step 100's exchange came before the signal: the next step stops
    resumed = _train_long("python", 1, 32, out)
    reference = _train_long("python", 1, 32, tmp_path / "uninterrupted")
    for name, value in reference["model"].items():
        assert torch.allclose(resumed["model"][name], value, rtol=0, atol=1e-6), name


def _train_long(launcher: str, nproc: int, batch_size: int, out: Path) -> Dict:
    result = launch(launcher, SCRIPT, ["--steps", str(LONG), "--batch-size", str(batch_size), "--output-dir",
                                       str(out)], nproc=nproc, timeout=TIMEOUT).check()
    assert f"after {LONG} steps" in result.output, result.output[-2000:]
    checkpoint = out / "checkpoints" / f"checkpoint-{LONG:09d}.pt"
    return {"model": torch.load(checkpoint, weights_only=True)["model"], "output": result.output}
