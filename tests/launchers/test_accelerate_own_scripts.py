"""Accelerate's own test scripts, as installed (``accelerate/test_utils/scripts``), with no line changed,
through ``python -m unified_dist.accelerate`` under launchers Accelerate does not read (issue #41: "the
assertions of Accelerate's test_ops.py and test_sync.py pass under every launcher").

- ``test_ops.py`` (gather, gather_object, broadcast, pad_across_processes, reduce...) is built on
  ``PartialState()``, which on a machine without CUDA runs every process alone (``DistributedType.NO``)
  even under torchrun: every assertion then holds trivially. ``unified_dist.accelerate.PartialState``
  joins the launcher's processes first.
- ``test_sync.py`` (``no_sync``, ``accumulate``, with an optimizer and a scheduler) and ``test_script.py``
  (the script ``accelerate test`` runs: process execution, splitting, the data loaders, RNG
  synchronisation, training parity, breakpoints) are built on ``Accelerator()``.

Each script asserts its own expectations (a failed one exits non-zero); here each launch must exit 0,
the main process must report a world of 2 over gloo, and no process may report a world of 1. One launch
per (launcher, script); torchrun and ``accelerate launch`` join ``Accelerator()`` already, so torchrun
runs ``test_ops.py`` only (the ``PartialState`` case). ``test_distributed_data_loop.py`` is left out: its
uneven-inputs test deadlocks on CPU (Accelerate: "Joining uneven inputs is only supported for multi-GPU
training"), and it asserts two GPUs.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from unified_dist.testing.launchers import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TIMEOUT = 180
LAUNCHES = [("horovodrun", "test_ops"), ("horovodrun", "test_sync"), ("horovodrun", "test_script"),
            ("srun", "test_ops"), ("srun", "test_sync"), ("mpirun", "test_ops"), ("mpirun", "test_sync"),
            ("torchrun", "test_ops")]
FIXTURE = {"srun": "slurm_cluster", "mpirun": "mpirun_available"}
# what each script prints on its main process once its checks ran (a script stopping early prints fewer)
DONE = {"test_ops": "testing sending tensors across devices",
        "test_sync": "**Test `accumulate` gradient accumulation with optimizer and scheduler",
        "test_script": "**Test reinstantiated state**"}
# the line that shows the world: test_sync prints it only in a multi-process world
WORLD = {"test_ops": "Num processes: 2", "test_script": "Num processes: 2",
         "test_sync": "**Test Distributed `no_sync` context manager**"}


def script_path(name: str) -> str:
    import accelerate

    return str(Path(accelerate.__file__).parent / "test_utils" / "scripts" / f"{name}.py")


@pytest.mark.parametrize("launcher,script", LAUNCHES, ids=[f"{a}-{b}" for a, b in LAUNCHES])
def test_accelerates_own_script_passes_over_the_launchers_world(launcher, script, request):
    env = request.getfixturevalue(FIXTURE[launcher]) if launcher in FIXTURE else None
    result = launch(launcher, "-m", ["unified_dist.accelerate", script_path(script)], nproc=2,
                    timeout=TIMEOUT, env=env if isinstance(env, dict) else None)
    result.check()
    out = result.output
    assert DONE[script] in out, out[-3000:]
    assert WORLD[script] in out, out[-3000:]
    assert not re.search(r"Num processes: 1\b|DistributedType\.NO\b", out), out[-3000:]
    if script != "test_sync":
        assert "DistributedType.MULTI_CPU  Backend: gloo" in out, out[-3000:]


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
