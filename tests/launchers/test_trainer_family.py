"""Issue #51: code that reaches Accelerate through a library (transformers' ``Trainer``, TRL's ``SFTTrainer``, a
PEFT LoRA adapter) runs unchanged on every launcher through ``python -m unified_dist.accelerate`` (also as
``unified-dist launch --accelerate-api``), with the numbers of the same script under torchrun.

The script is tests/launchers/workers/trainer_family.py; it never imports unified_dist. Six launches, shared by
every assertion:

1. ``torchrun --nproc_per_node 2 script.py`` (transformers' own path; no unified_dist): the reference, every part;
   its ``checkpoint-6`` (mid-epoch 0 of 2) is what the others resume from;
2. ``python -m unified_dist.accelerate script.py --batch 8`` (one process, the 2 x 4 examples of a step in one batch):
   the ``mean`` part;
3. ``unified-dist launch --backend accelerate --accelerate-api`` (``accelerate launch -m unified_dist.accelerate``):
   the Trainer, then a run resumed from torchrun's checkpoint;
4. ``unified-dist launch --backend horovod --accelerate-api`` (horovodrun): every part but ``mean``, and the
   resumed run;
5. a real ``srun`` through the runner: every part but ``mean``, and the resumed run;
6. ``mpirun`` through the runner, the script given ``--no-use-cpu`` (``TrainingArguments`` left at its
   default on this GPU-less machine): the Trainer, and the resumed run.

Every 2-process launch must equal torchrun's bitwise (float64 parameter sums, losses, predictions): the data
order is Accelerate's own under every launcher, and gloo sums 2 values in one order. One process with the whole
batch against two is physics, not the same arithmetic: that part trains a float64 model, compared to
MEAN_REL_TOL. Expected values that are not the reference's come from physics computed in the script in plain torch
(the mean loss over the held-out set) or from the data sizes (16 steps = 64 examples / 8 per step x 2 epochs).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path

import pytest

from unified_dist.backends.ports import free_port
from unified_dist.testing.launchers import BIN, ROOT, child_env, command, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TIMEOUT = 240
SCRIPT = ROOT / "tests" / "launchers" / "workers" / "trainer_family.py"
STEPS = 64 // 8 * 2  # 64 examples, 8 per optimizer step (2 processes x 4, or 1 x 8), 2 epochs
RUNNER = ["-m", "unified_dist.accelerate", str(SCRIPT)]
FAMILY = ["--parts", "trainer,sft,lora"]
"""The parts check_family reads: the ``mean`` part's 1 x 8 = 2 x 4 physics takes torchrun's 2 processes (launch 1)
against one (launch 2); run again under horovodrun and srun it was read by no assertion (~1 s a process)."""


def rows(path: Path) -> dict:
    """The main process's JSON lines by part; a part written twice (two processes that each believed they
    were the main one) fails here."""
    found = {}
    for row in map(json.loads, path.read_text().splitlines()):
        assert row["part"] not in found, f"{row['part']} written twice: a process trained alone"
        found[row["part"]] = row
    return found


def launch(cmd: list, folder: Path, name: str, args: list, env: dict = None) -> dict:
    out = folder / f"{name}.jsonl"
    run([*cmd, "--out", str(out), "--output-dir", str(folder / name), *args], TIMEOUT, child_env(env)).check()
    return rows(out)


def unified_dist_launch(backend: str, port: bool = False) -> list:
    extra = ["--master-port", str(free_port())] if port else []
    return [str(BIN / "unified-dist"), "launch", "--backend", backend, "--nproc", "2", *extra, "--accelerate-api",
            str(SCRIPT)]


@pytest.fixture(scope="module")
def runs(module_dirs):
    """Launches 1-4 of the module doc, by launcher name; ``folder`` holds their output."""
    tmp = module_dirs.mktemp("trainer_family")
    found = {"folder": tmp}
    resume = ["--resume", str(tmp / "torchrun" / "checkpoint-6")]
    # two at a time: the one-process run beside torchrun's, then the two launches that resume torchrun's checkpoint
    # side by side. Each has its own output and folder and its own port (torchrun --standalone's, the free port
    # given accelerate's, horovodrun's own); a launch waits a good part of its time (rendezvous, checkpoint writes,
    # the agent), which the other's processes use; no assertion reads a timing
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        one = pool.submit(launch, [str(BIN / "python"), *RUNNER], tmp, "python", ["--batch", "8", "--parts", "mean"])
        try:
            found["torchrun"] = launch(command("torchrun", str(SCRIPT)), tmp, "torchrun", [])
        finally:
            found["python"] = one.result()
        resumed = pool.submit(launch, unified_dist_launch("horovod"), tmp, "horovodrun", [*FAMILY, *resume])
        try:
            found["accelerate"] = launch(unified_dist_launch("accelerate", port=True), tmp, "accelerate",
                                         ["--parts", "trainer", *resume])
        finally:
            found["horovodrun"] = resumed.result()
    return found


@pytest.fixture(scope="module")
def srun_run(runs, slurm_cluster):
    tmp = runs["folder"]
    cmd = command("srun", "-m", RUNNER[1:])
    return launch(cmd, tmp, "srun", [*FAMILY, "--resume", str(tmp / "torchrun" / "checkpoint-6")], slurm_cluster)


@pytest.fixture(scope="module")
def mpirun_run(runs, mpirun_available):
    tmp = runs["folder"]
    cmd = command("mpirun", "-m", RUNNER[1:])
    return launch(cmd, tmp, "mpirun", ["--parts", "trainer", "--no-use-cpu",
                                       "--resume", str(tmp / "torchrun" / "checkpoint-6")],
                  {"MASTER_PORT": str(free_port())})


def check_trainer(got: dict, reference: dict) -> None:
    """The Trainer part of a 2-process launch through the runner against torchrun's."""
    assert got["accelerator"] == "unified_dist.accelerate.accelerator"
    assert (got["world_size"], got["distributed_type"]) == (2, "DistributedType.MULTI_CPU")
    # the launcher's world as the script's own os.environ reads, before anything else ran
    assert (got["world_size_variable"], got["local_rank_variable"]) == (2, 0)
    assert got["global_step"] == STEPS
    assert got["checkpoints"] == reference["checkpoints"] == ["checkpoint-12", "checkpoint-16", "checkpoint-6"]
    assert got["param_sum"] == reference["param_sum"]  # bitwise: Accelerate's data order, the same arithmetic
    assert got["eval_loss"] == reference["eval_loss"]
    assert got["predictions_shape"] == [21, 2]  # each held-out example once, none of the padding
    assert got["predictions_sum"] == reference["predictions_sum"]


def check_resumed(got: dict, reference: dict) -> None:
    """A run resumed from torchrun's checkpoint-6 ends with torchrun's uninterrupted parameters."""
    assert got["global_step"] == STEPS
    assert got["param_sum"] == reference["param_sum"]
    assert got["eval_loss"] == reference["eval_loss"]


def test_the_reference_is_transformers_own_path_over_two_processes(runs):
    reference = runs["torchrun"]["trainer"]
    assert reference["accelerator"] == "accelerate.accelerator"  # no unified_dist in that process
    assert (reference["world_size"], reference["distributed_type"]) == (2, "DistributedType.MULTI_CPU")
    assert reference["global_step"] == STEPS


def test_trainer_under_accelerate_launch_gives_torchruns_numbers_and_resumes_its_checkpoint(runs):
    reference = runs["torchrun"]["trainer"]
    check_trainer(runs["accelerate"]["trainer"], reference)
    check_resumed(runs["accelerate"]["resume"], reference)


def test_trainer_sft_and_lora_under_horovodrun_give_torchruns_numbers(runs):
    check_family(runs["horovodrun"], runs["torchrun"])


def test_trainer_sft_and_lora_under_srun_give_torchruns_numbers(runs, srun_run):
    check_family(srun_run, runs["torchrun"])


def test_trainer_under_mpirun_without_use_cpu_gives_torchruns_numbers(runs, mpirun_run):
    """``TrainingArguments()`` without ``use_cpu`` on a GPU-less machine: the runner's ``PartialState`` still
    forms one gloo group of mpirun's processes (Accelerate's own would run each alone)."""
    check_trainer(mpirun_run["trainer"], runs["torchrun"]["trainer"])
    check_resumed(mpirun_run["resume"], runs["torchrun"]["trainer"])


def check_family(got: dict, reference: dict) -> None:
    check_trainer(got["trainer"], reference["trainer"])
    check_resumed(got["resume"], reference["trainer"])
    sft, lora = got["sft"], got["lora"]
    assert (sft["world_size"], lora["world_size"]) == (2, 2)
    assert sft["global_step"] == reference["sft"]["global_step"] == 10  # 40 texts, 8 per step, 2 epochs
    assert sft["param_sum"] == reference["sft"]["param_sum"]
    assert sft["train_loss"] == reference["sft"]["train_loss"]
    assert lora["global_step"] == STEPS
    assert lora["trainable_sum"] == reference["lora"]["trainable_sum"]
    assert lora["eval_loss"] == reference["lora"]["eval_loss"]


MEAN_REL_TOL = 1e-10
"""The ``mean`` part trains in float64 (tests/launchers/workers/trainer_family.py). One process sums the 8 examples of
a step where two sum 4 each and average: each sum (<= 64 terms: widths, tokens, examples) moves by at most
64 * 2**-53 ~ 7e-15 of its terms' magnitudes, so gradients (<= 1e-2) by ~1e-16. AdamW (lr 1e-3, 16 steps) moves a
weight by at most lr * dg / eps ~ 1e-11 per step even where a gradient is ~0 (eps = 1e-8), 2e-10 in 16 steps, and
by ~lr * dg / |g| ~ 1e-17 elsewhere: the parameter sum (157; ~25,000 weights) moves by ~1e-14 relative, ~1e-12 if
a few weights took the worst case. The evaluation loss (a mean over 24 examples in batches of 4, against one mean)
by ~24 * 2**-53 ~ 3e-15 relative. Measured 0.0 for both (2026-11-28); in float32 1 x 8 and 2 x 4 differed by
8e-8 of the parameter sum against the former bound 1e-6, on an AMD EPYC. A step on other examples, or one step
more or less, moves the parameter sum by ~sqrt(25,000) x lr ~ 0.16 (1e-3 relative)."""


def test_one_process_with_the_whole_batch_gives_two_processes_update(runs):
    """Physics: 1 process x batch 8 (python through the runner) = 2 processes x batch 4 (torchrun), with each
    process's loss its batch's mean (``average_tokens_across_devices=False``); the evaluation loss over a
    held-out set that splits evenly equals the mean loss computed in plain torch in either."""
    one, two = runs["python"]["mean"], runs["torchrun"]["mean"]
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert one["global_step"] == two["global_step"] == STEPS
    assert one["param_sum"] == pytest.approx(two["param_sum"], rel=MEAN_REL_TOL, abs=0)
    for got in (one, two):
        assert got["eval_loss"] == pytest.approx(got["mean_loss"], rel=MEAN_REL_TOL)


def test_transformers_default_reports_the_loss_times_the_number_of_processes(runs):
    """The issue's eval_loss 1.374 against 0.687 is transformers' own: with ``average_tokens_across_devices``
    (its default) and a model whose forward takes loss keyword arguments, ``Trainer.compute_loss`` multiplies the
    loss by the number of processes (meant for losses summed over the tokens of the whole world; BERT's
    classification loss is a mean): the reported ``eval_loss`` is 2 x the mean loss computed in plain torch,
    under torchrun as under every launcher here (docs/accelerate-migration.md)."""
    reference = runs["torchrun"]["trainer"]
    # float32: the Trainer's loss over 24 examples in float32 (each cross-entropy a few roundings of 6e-8, their
    # mean 24 more) against the float64 mean of the same logits: <= ~1.5e-6 relative at worst, 2.4e-8 measured;
    # the factor 2 is off by 100 %
    assert reference["eval_loss"] == pytest.approx(2 * reference["mean_loss"], rel=1e-5)
    assert runs["torchrun"]["mean"]["eval_loss"] == pytest.approx(runs["torchrun"]["mean"]["mean_loss"],
                                                                   rel=MEAN_REL_TOL)


def test_the_script_imports_no_unified_dist():
    text = SCRIPT.read_text()
    assert "import unified_dist" not in text and "from unified_dist" not in text
    assert os.path.basename(str(SCRIPT)) == "trainer_family.py"
