"""Issue 59 item 4: the DeepSpeed setups Accelerate and transformers users already have run unchanged through
``python -m unified_dist.accelerate`` on a machine without a GPU, with the numbers of one process on the global batch.

The script is tests/launchers/workers/accelerate_deepspeed_scripts.py (it never imports unified_dist): an Accelerate
loop with ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_clipping=0.2))``, then transformers'
``Trainer`` with ``TrainingArguments(deepspeed="deepspeed_auto.json")``, a config whose batch sizes, accumulation
and clipping say ``"auto"``. Two launches, 2 processes each, shared by every assertion: ``torchrun -m
unified_dist.accelerate`` and ``horovodrun ... python -m unified_dist.accelerate`` (whose variables Accelerate and
DeepSpeed do not read: the runner exports the world).

Accelerate alone cannot do this here: without ``cpu=True`` its DeepSpeed path starts DeepSpeed's communication with
no backend and counts a world of one (DeepSpeed then stops: ``train_batch_size ... 4 != 4 * 1 * 2``); with
``cpu=True`` it leaves DeepSpeed out. The runner gives that path the backend gloo (DeepSpeed's CPU accelerator uses
it without oneCCL), and refuses in one line a plugin Accelerate would leave out (tests/unit/backends/
test_deepspeed_backend.py).

Physics: 2 ranks x batch 4 must give the weights of 1 process x batch 8, SGD with momentum, each step's gradient
clipped to norm 0.2 (below every step's norm of this run, so the clip is active and the "auto" clipping must have
become the Trainer's ``max_grad_norm``), computed in float64 with plain torch in this process; DeepSpeed runs float32,
so the bound is :func:`test_deepspeed_engine.bound`'s derivation (clipping scales each gradient by 0.2 / norm, which
leaves that SGD bound as it is).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from unified_dist.testing.launchers import ROOT, child_env, command, run

sys.path.insert(0, str(ROOT / "tests" / "launchers"))
sys.path.insert(0, str(ROOT / "tests" / "launchers" / "workers"))
import deepspeed_worker as worker  # noqa: E402
from test_deepspeed_engine import bound, max_difference, reference  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TIMEOUT = 300  # a launch takes 50-80 s on 2 shared cores (two DeepSpeed engines)
SCRIPT = ROOT / "tests" / "launchers" / "workers" / "accelerate_deepspeed_scripts.py"
CONFIG = ROOT / "tests" / "launchers" / "workers" / "deepspeed_auto.json"
PARTS = ("plugin", "trainer")
LAUNCHERS = ["torchrun", pytest.param("horovodrun", marks=pytest.mark.horovod)]


def launch(launcher: str, folder: Path) -> dict:
    """The main process's rows by part; a part written twice (two processes that each believed they were the
    main one) fails here."""
    out = folder / f"{launcher}.jsonl"
    args = ["unified_dist.accelerate", str(SCRIPT), "--out", str(out), "--output-dir", str(folder / launcher),
            "--deepspeed", str(CONFIG)]
    run(command(launcher, "-m", args), TIMEOUT, child_env()).check()
    found = {}
    for row in map(json.loads, out.read_text().splitlines()):
        assert row["part"] not in found, f"{row['part']} written twice: a process trained alone"
        found[row["part"]] = row
    return found


@pytest.fixture(scope="module")
def runs(module_dirs):
    """Each launch once per module, by the first test that needs it."""
    folder = module_dirs.mktemp("accelerate_deepspeed")
    done: dict = {}

    def get(launcher: str) -> dict:
        if launcher not in done:
            done[launcher] = launch(launcher, folder)
        return done[launcher]
    return get


@pytest.fixture(scope="module")
def physics():
    """1 process x batch 8 in float64 (plain torch), clipped to worker.CLIP: the weights and the bound."""
    norms: list = []
    weights, G, g_min, W = reference("sgd", 1, clip=worker.CLIP, norms=norms)
    assert min(norms) > worker.CLIP  # the clip acts on every step
    return weights, bound("sgd", 1, G, g_min, W)


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("part", PARTS)
def test_deepspeed_runs_through_accelerates_own_path_on_two_cpu_processes(runs, launcher, part):
    row = runs(launcher)[part]
    assert (row["distributed_type"], row["num_processes"]) == ("DistributedType.DEEPSPEED", 2)
    assert (row["engine"], row["zero_stage"]) == ("DeepSpeedEngine", 2)
    if part == "trainer":  # TrainingArguments' own state is DeepSpeed's too, as on GPUs
        assert row["arguments_state"] == "DistributedType.DEEPSPEED"
        assert row["global_step"] == worker.ROWS // (2 * worker.BATCH)


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("part", PARTS)
def test_two_ranks_give_one_process_on_the_global_batch(runs, physics, launcher, part):
    weights, limit = physics
    assert max_difference(runs(launcher)[part]["weights"], weights) <= limit
