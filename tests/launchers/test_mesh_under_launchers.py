"""Layouts on a device mesh under real launchers with 4 processes (issue 26): HSDP 2x2, FSDP x TP 2x2,
TP 4 and FSDP + activation checkpointing + CPU offload, each equal to one plain process after AdamW
steps with accumulation, a ragged last batch and clipping (tests/launchers/workers/mesh_worker.py).

- torchrun x 4: the four layouts from code, one ``ud.init`` .. ``ud.shutdown`` each, in one launch, then
  FSDP x TP 2x2 with ``tp_plan="auto"`` on a tiny ``LlamaForCausalLM`` (built from its config);
- accelerate launch x 4 with its own flags (``--use_parallelism_config --parallelism_config_dp_replicate_size 2
  --parallelism_config_dp_shard_size 1 --parallelism_config_tp_size 2 --fsdp_activation_checkpointing true``):
  the layout and the checkpointing come from the launcher, the code says nothing (on a CPU, where
  Accelerate's own ``ParallelismConfig`` refuses to run);
- srun -n 4 (a real one-node SLURM): HSDP with ``reshard_after_forward=False`` and FSDP x TP from code;
- two hosts x 2 processes (torchrun, static master): ``dp_replicate="nodes"`` shards inside a host and
  replicates across (tests/launchers/multinode/test_multinode_contract.py has the hosts).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Tuple

import pytest

from unified_dist.testing.launchers import BIN, Result, child_env, free_port, launch, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = "tests/launchers/workers/mesh_worker.py"
CHECKS = ("identity_knows_the_mesh", "tensor_parallel_peers_get_the_same_batches_and_each_sample_comes_once",
          "adamw_with_accumulation_ragged_batch_and_clipping_equals_one_process",
          "accumulating_micro_steps_send_no_gradient", "parameters_are_laid_out_on_the_mesh",
          "activation_checkpointing_recomputes_blocks_in_backward",
          "gather_for_metrics_returns_each_example_once_in_order", "save_gathers_the_full_state_from_the_mesh")
TORCHRUN_LAYOUTS = ("hsdp", "fsdp_tp", "tp", "fsdp_ac_offload", "llama")
SRUN_LAYOUTS = ("hsdp_keep", "fsdp_tp")  # HSDP keeping parameters gathered from forward to backward
ACCELERATE_FLAGS = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_activation_checkpointing", "true",
                    "--use_parallelism_config", "--parallelism_config_dp_replicate_size", "2",
                    "--parallelism_config_dp_shard_size", "1", "--parallelism_config_tp_size", "2"]
TIMEOUT = 180  # a launch takes 15-60 s on 2 cores


def accelerate_command(out: Path):
    return [str(BIN / "accelerate"), "launch", *ACCELERATE_FLAGS, "--num_processes", "4", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
            WORKER, "--layouts", "launcher", "--expect", "2,1,2", "--out", str(out)]


class Launches:
    """Each launch once per session, by the first test item that needs it."""

    def __init__(self, root: Path):
        self.root = root
        self._done: Dict[str, Tuple[Result, Dict[int, dict]]] = {}

    def get(self, launcher: str, env=None) -> Tuple[Result, Dict[int, dict]]:
        if launcher not in self._done:
            out = self.root / launcher
            out.mkdir()
            if launcher == "accelerate":
                result = run(accelerate_command(out), TIMEOUT, child_env(env))
            else:
                layouts = TORCHRUN_LAYOUTS if launcher == "torchrun" else SRUN_LAYOUTS
                result = launch(launcher, WORKER, ["--layouts", ",".join(layouts), "--out", str(out)], nproc=4,
                                timeout=TIMEOUT, env=env)
            ranks = {r: json.loads((out / f"mesh_rank{r}.json").read_text())
                     for r in range(4) if (out / f"mesh_rank{r}.json").exists()}
            self._done[launcher] = (result, ranks)
        return self._done[launcher]


@pytest.fixture(scope="session")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory.mktemp("mesh"))


def _assert_check(result: Result, ranks: Dict[int, dict], layout: str, check: str) -> None:
    result.check()
    assert sorted(ranks) == [0, 1, 2, 3], f"missing rank results:\n{result.output[-3000:]}"
    for r, data in ranks.items():
        assert data[layout][check] == "ok", f"rank {r}, {layout}: {data[layout][check]}"


CASES = ([("torchrun", layout, check) for layout in TORCHRUN_LAYOUTS if layout != "llama" for check in CHECKS]
         + [("torchrun", "llama", "tp_plan_auto_on_a_tiny_llama_equals_one_process")]
         + [("accelerate", "launcher", check) for check in CHECKS])


@pytest.mark.parametrize("launcher,layout,check", CASES, ids=["-".join(c) for c in CASES])
def test_layout_under_launcher(launcher, layout, check, launches):
    _assert_check(*launches.get(launcher), layout, check)


def test_accelerate_launch_flags_choose_the_layout_and_checkpointing(launches):
    """The accelerate launch's own flags (not the code) turned on FSDP2 and activation checkpointing."""
    result, ranks = launches.get("accelerate")
    result.check()
    for r, data in ranks.items():
        assert data["launcher"]["config"] == {"sharding": "fsdp", "cpu_offload": False,
                                              "activation_checkpointing": True, "reshard_after_forward": True}, r


def test_offload_and_checkpointing_layout_ran_with_both(launches):
    result, ranks = launches.get("torchrun")
    result.check()
    assert ranks[0]["fsdp_ac_offload"]["config"]["cpu_offload"] is True
    assert ranks[0]["fsdp_ac_offload"]["config"]["activation_checkpointing"] is True


SRUN_CASES = [(layout, check) for layout in SRUN_LAYOUTS for check in CHECKS]


@pytest.mark.parametrize("layout,check", SRUN_CASES, ids=["-".join(c) for c in SRUN_CASES])
def test_layout_under_srun(layout, check, launches, request):
    env = request.getfixturevalue("slurm_cluster") or {}
    _assert_check(*launches.get("srun", env=env), layout, check)
