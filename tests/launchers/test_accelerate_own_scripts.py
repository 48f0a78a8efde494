"""Accelerate's own test scripts, as installed (``accelerate/test_utils/scripts``), with no line changed,
through ``python -m unified_dist.accelerate`` under launchers Accelerate does not read (issue #41: "the
assertions of Accelerate's test_ops.py and test_sync.py pass under every launcher"; issue #58, item 10: all four,
``test_distributed_data_loop.py`` included, one launch per launcher).

- ``test_ops.py`` (gather, gather_object, broadcast, pad_across_processes, reduce...) is built on
  ``PartialState()``, which on a machine without CUDA runs every process alone (``DistributedType.NO``)
  even under torchrun: every assertion then holds trivially. ``unified_dist.accelerate.PartialState``
  joins the launcher's processes first.
- ``test_sync.py`` (``no_sync``, ``accumulate``, with an optimizer and a scheduler) and ``test_script.py``
  (the script ``accelerate test`` runs: process execution, splitting, the data loaders, RNG
  synchronisation, training parity, breakpoints) are built on ``Accelerator()``.
- ``test_distributed_data_loop.py`` (even and uneven batches, ``join_uneven_inputs`` with a DDP model and 2 vs 1
  batches, pickling, the data loaders, stateful loaders resumed): Accelerate's ``join_uneven_inputs`` does
  nothing on ``MULTI_CPU`` ("only supported for multi-GPU training"), so the rank with fewer batches leaves
  while the other waits in its gradient all-reduce: a hang. ``unified_dist.accelerate.Accelerator`` joins there.

One launch per launcher runs the four scripts in turn (tests/launchers/workers/accelerate_own_scripts.py: each
script's ``main()`` in a state a fresh process would have). Each script asserts its own expectations; here every
process must report every test the script's ``main()`` calls over a world of 2, in the order below (read from
the scripts of Accelerate 1.15: the tests ``main()`` runs on ``MULTI_CPU`` with 2 processes), and no process may
report a world of 1.
"""
from __future__ import annotations

import re

import pytest

from unified_dist.testing.launchers import ROOT, child_env, command, launch, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TIMEOUT = 600
LAUNCHERS = ["torchrun", "horovodrun", "mpirun", "srun"]
FIXTURE = {"srun": "slurm_cluster", "mpirun": "mpirun_available"}
WORKER = ROOT / "tests" / "launchers" / "workers" / "accelerate_own_scripts.py"
# the tests each script's main() calls on MULTI_CPU with 2 processes, in order (a GPU-only or
# single-process branch of main() would call others: test_sync's test_noop_sync, test_gradient_accumulation)
TESTS = {
    "test_ops": ["test_gather", "test_gather_object", "test_gather_non_contiguous", "test_broadcast",
                 "test_pad_across_processes", "test_reduce_sum", "test_reduce_mean", "test_reduce_max",
                 "test_op_checker", "test_copy_tensor_to_devices"],
    "test_sync": ["test_dataloader_break", "test_distributed_sync", "test_distributed_sync_multiple_fwd",
                  "test_gradient_accumulation_with_opt_and_scheduler"],
    "test_script": ["init_state_check", "process_execution_check", "test_split_between_processes_list",
                    "test_split_between_processes_nested_dict", "test_split_between_processes_tensor",
                    "test_split_between_processes_evenly", "test_split_between_processes_dataset",
                    "rng_sync_check", "dl_preparation_check", "central_dl_preparation_check",
                    "custom_sampler_check", "check_seedable_sampler", "check_seedable_sampler_with_data_seed",
                    "check_seedable_sampler_in_batch_sampler_shard", "training_check", "training_check",
                    "test_trigger", "test_reinstantiated_state"],
    "test_distributed_data_loop": [
        "test_default_ensures_even_batch_sizes", "test_can_disable_even_batches", "test_can_join_uneven_inputs",
        "test_join_can_override_even_batches", "test_join_can_override_for_mixed_type_dataloaders",
        "test_join_raises_warning_for_iterable_when_overriding_even_batches",
        "test_join_raises_warning_for_non_ddp_distributed", "test_pickle_accelerator", "test_data_loader",
        "test_data_loader", "test_data_loader", "test_data_loader", "test_stateful_dataloader",
        "test_stateful_dataloader_save_state"],
}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_accelerates_own_scripts_pass_whole_in_one_launch(launcher, request, tmp_path):
    env = request.getfixturevalue(FIXTURE[launcher]) if launcher in FIXTURE else None
    cmd = command(launcher, "-m", ["unified_dist.accelerate", str(WORKER), str(tmp_path), *TESTS], nproc=2)
    result = run(cmd, TIMEOUT, child_env(env if isinstance(env, dict) else None))
    out = result.output
    reports = re.findall(r"own-scripts (\S+) (rank \S+ (?:of \d+|alone)): (.{0,40})", out, re.MULTILINE)
    print(f"{launcher}: " + "; ".join(f"{name} {rank}: {what}" for name, rank, what in reports))  # the counts
    result.check()
    for name, expected in TESTS.items():
        for rank in ("0", "1"):
            line = rf"own-scripts {name} rank {rank} of 2: {len(expected)} passed \([0-9.]+ s\): {' '.join(expected)}$"
            assert re.search(line, out, re.MULTILINE), f"{launcher}: {name} on rank {rank}\n{out[-4000:]}"
    assert "DistributedType.MULTI_CPU  Backend: gloo" in out, out[-3000:]
    assert not re.search(r"Num processes: 1\b|DistributedType\.NO\b", out), out[-3000:]


def test_accelerates_own_partial_state_under_mpirun_joins_the_launchers_world(mpirun_available, tmp_path):
    """Issue #51: ``accelerate.state.PartialState()`` (the name transformers' ``TrainingArguments`` and
    Accelerate's ``AcceleratorState`` use; no ``cpu=True``) as the first thing a script run through the runner does
    under mpirun: both processes are one gloo group of 2 (``MULTI_CPU``), where Accelerate's own runs each alone
    on this GPU-less machine (``DistributedType.NO``) or fails (``MASTER_ADDR expected``). Unit test of the
    exported variables: tests/unit/test_accelerate_module.py (``-k exports_the_launchers_world``)."""
    probe = tmp_path / "own_state.py"
    probe.write_text("from accelerate.state import PartialState\nstate = PartialState()\n"
                     "print(f'joined {state.process_index} of {state.num_processes} {state.distributed_type}')\n")
    result = launch("mpirun", "-m", ["unified_dist.accelerate", str(probe)], nproc=2, timeout=60)
    result.check()
    for rank in (0, 1):
        assert f"joined {rank} of 2 DistributedType.MULTI_CPU" in result.output, result.output[-3000:]
