"""``unified_dist.accelerate`` (issue #41): an Accelerate script with one import changed runs under
torchrun, horovodrun and ``accelerate launch`` with the numbers of the unchanged script under
``accelerate launch``, and ``save_state`` folders move between launchers and between Accelerate and
unified_dist.

The script is tests/launchers/workers/accelerate_example.py (the shape of Accelerate's ``nlp_example.py`` and
``by_feature/checkpointing.py``); the reference is that script as written, under ``accelerate launch``
with 2 processes, i.e. real Accelerate. The changed copy differs by the import line only (the test
writes it). Five launches, shared by every assertion:

1. ``accelerate launch``, changed import: a full run, ``save_state`` after epoch 0 (folder U);
2. ``accelerate launch``, the script as written (the reference): a full run, ``save_state`` (folder A),
   then a run resumed from folder U (real Accelerate loads unified_dist's folder);
3. ``torchrun -m unified_dist.accelerate script.py``, the script as written (no line changed): a full
   run, then one resumed from folder A;
4. ``horovodrun``, changed import: a full run, then one resumed from folder A;
5. a real ``srun``, the script as written through the runner: a full run, then one resumed from folder A.

Expected values that are not the reference's are computed here: the learning rate after each epoch
follows from Accelerate's rule (a prepared scheduler steps once per process per optimizer step), the
evaluation sees each of its 37 examples once, ``reduce`` sums by default. Tolerance 1e-6 relative on
the float64 parameter sum: a lost or doubled step, another data order or a world of one moves it by
far more (all runs here were bitwise equal, 2026-11-26).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from unified_dist.testing.launchers import BIN, ROOT, child_env, command, run

TIMEOUT = 180
SCRIPT = ROOT / "tests" / "launchers" / "workers" / "accelerate_example.py"
ORIGINAL_IMPORT = "from accelerate import Accelerator\n"
CHANGED_IMPORT = "from unified_dist.accelerate import Accelerator\n"
LR, EPOCHS, STEPS_PER_EPOCH, PROCESSES = 0.05, 3, 3, 2  # 96 examples, batch 8, 2 processes, accumulation 2
TOTAL = 12 * EPOCHS // 2  # the script's schedule length: len(train loader) * epochs // accumulation


def schedule(step: int) -> float:
    """The script's LambdaLR at scheduler step ``step``."""
    return LR * min(1.0, (step + 1) / 3) * max(0.0, 1 - step / TOTAL)


def changed_copy(folder: Path) -> Path:
    """The example with only its import line changed."""
    text = SCRIPT.read_text()
    assert text.count(ORIGINAL_IMPORT) == 1
    path = folder / "accelerate_example_ud.py"
    path.write_text(text.replace(ORIGINAL_IMPORT, CHANGED_IMPORT))
    return path


def results(path: Path) -> dict:
    """The main process's JSON lines, by run ("full", "resume")."""
    return {row["run"]: row for row in map(json.loads, path.read_text().splitlines())}


def launch(cmd: list, out: Path) -> dict:
    run(cmd, TIMEOUT, child_env()).check()
    return results(out)


@pytest.fixture(scope="module")
def runs(module_dirs):
    """Launches 1-3 of the module doc: their results by name, and the folders they saved."""
    tmp = module_dirs.mktemp("accelerate_compat")
    changed = changed_copy(tmp)
    found = {"folders": {"U": tmp / "U", "A": tmp / "A"}}
    found["ud_accelerate"] = launch(command("accelerate", str(changed), [
        "--out", str(tmp / "ud_accelerate.jsonl"), "--save", str(tmp / "U")]), tmp / "ud_accelerate.jsonl")
    found["reference"] = launch(command("accelerate", str(SCRIPT), [
        "--cpu", "--out", str(tmp / "reference.jsonl"), "--save", str(tmp / "A"), "--resume", str(tmp / "U")]),
        tmp / "reference.jsonl")
    found["torchrun"] = launch([str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={PROCESSES}", "-m",
                                "unified_dist.accelerate", str(SCRIPT), "--out", str(tmp / "torchrun.jsonl"),
                                "--resume", str(tmp / "A")], tmp / "torchrun.jsonl")
    found["tmp"] = tmp
    return found


@pytest.fixture(scope="module")
def horovod_runs(runs):
    """Launch 4: horovodrun, the changed import, resuming from Accelerate's folder A."""
    tmp = runs["tmp"]
    return launch(command("horovodrun", str(changed_copy(tmp)), [
        "--out", str(tmp / "horovodrun.jsonl"), "--resume", str(runs["folders"]["A"])]), tmp / "horovodrun.jsonl")


def check_like_reference(got: dict, reference: dict, module: str) -> None:
    assert got["class"] == module
    assert (got["num_processes"], got["distributed_type"]) == (PROCESSES, "DistributedType.MULTI_CPU")
    assert got["param_sum"] == pytest.approx(reference["param_sum"], rel=1e-6, abs=0)
    assert got["accuracy"] == reference["accuracy"]
    assert got["lr"] == pytest.approx(reference["lr"], rel=1e-9)


pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_one_import_changed_gives_accelerates_parameters_under_accelerate_launch_and_torchrun(runs):
    reference = runs["reference"]["full"]
    assert reference["class"] == "accelerate.accelerator"  # the unchanged script ran real Accelerate
    check_like_reference(runs["ud_accelerate"]["full"], reference, "unified_dist.accelerate.accelerator")
    check_like_reference(runs["torchrun"]["full"], reference, "unified_dist.accelerate.accelerator")


def test_one_import_changed_gives_accelerates_parameters_under_horovodrun(runs, horovod_runs):
    check_like_reference(horovod_runs["full"], runs["reference"]["full"], "unified_dist.accelerate.accelerator")


def test_the_unchanged_script_gives_accelerates_parameters_under_srun(runs, slurm_cluster):
    """Launch 5: a real srun (one-node SLURM), the script as written through ``python -m
    unified_dist.accelerate``, resuming from Accelerate's folder A (mpirun: test_accelerate_own_scripts.py)."""
    tmp = runs["tmp"]
    cmd = command("srun", "-m", ["unified_dist.accelerate", str(SCRIPT), "--out", str(tmp / "srun.jsonl"),
                                 "--resume", str(runs["folders"]["A"])])
    run(cmd, TIMEOUT, child_env(slurm_cluster)).check()
    got = results(tmp / "srun.jsonl")
    check_like_reference(got["full"], runs["reference"]["full"], "unified_dist.accelerate.accelerator")
    assert got["resume"]["param_sum"] == pytest.approx(runs["reference"]["full"]["param_sum"], rel=1e-6, abs=0)


@pytest.mark.horovod
def test_save_state_folders_resume_across_launchers_and_libraries(runs, horovod_runs):
    """U (unified_dist under accelerate launch) resumed by real Accelerate; A (real Accelerate) resumed under
    torchrun and horovodrun: each ends with the uninterrupted run's parameters, epochs 1-2 evaluated alike."""
    full = runs["reference"]["full"]
    for resumed in (runs["reference"]["resume"], runs["torchrun"]["resume"], horovod_runs["resume"]):
        assert resumed["param_sum"] == pytest.approx(full["param_sum"], rel=1e-6, abs=0)
        assert resumed["accuracy"] == full["accuracy"][1:]
        assert resumed["lr"] == pytest.approx(full["lr"][1:], rel=1e-9)


def test_save_state_writes_accelerates_folder_layout(runs):
    names = {p.name for p in runs["folders"]["U"].iterdir()}
    assert names == {p.name for p in runs["folders"]["A"].iterdir()}
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
            "random_states_1.pkl"} <= names


@pytest.mark.horovod
def test_scheduler_steps_once_per_process_per_optimizer_step_as_accelerate(runs, horovod_runs):
    """Accelerate's rule, kept: the facade's own ``ud.prepare`` steps a scheduler once per optimizer step
    (docs/accelerate-migration.md); here 2 processes step it twice per optimizer step."""
    expected = [schedule(PROCESSES * STEPS_PER_EPOCH * (epoch + 1)) for epoch in range(EPOCHS)]
    for got in (runs["reference"]["full"], runs["ud_accelerate"]["full"], runs["torchrun"]["full"],
                horovod_runs["full"]):
        assert got["lr"] == pytest.approx(expected, rel=1e-9)
        assert got["optimizer_steps"] == EPOCHS * STEPS_PER_EPOCH


@pytest.mark.horovod
def test_reduce_sums_and_gather_for_metrics_counts_each_example_once(runs, horovod_runs):
    for got in (runs["reference"]["full"], runs["ud_accelerate"]["full"], runs["torchrun"]["full"],
                horovod_runs["full"]):
        assert got["reduce"] == 1.0 + 2.0  # Accelerate's reduce: "sum" by default (ud.all_reduce: "mean")
        assert [seen for _, seen in got["accuracy"]] == [37] * EPOCHS
