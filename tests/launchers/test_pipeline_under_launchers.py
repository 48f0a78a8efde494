"""Pipeline parallelism under torchrun (issue 61): 2 stages on 2 ranks, pp 2 x FSDP2 2 and pp 2 x TP 2 on 4 ranks,
each case equal to one plain process on the same global batches in float64
(tests/launchers/workers/pipeline_worker.py derives the 1e-12 bound).

One launch per world size runs every case of that size in the same processes (one ``ud.init`` ..
``ud.shutdown`` each) and prints one JSON line per rank and case; each test asserts one claim of one case.
"""
from __future__ import annotations

import json
from typing import Dict, List, Tuple

import pytest

from unified_dist.testing.launchers import Result, launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = "tests/launchers/workers/pipeline_worker.py"
TIMEOUT = 240  # each launch took 25-50 s on 2 cores
CASES = {2: ("pp_gpipe_sgd", "pp_1f1b_sgd", "pp_gpipe_adamw", "pp_1f1b_adamw", "pp_split_1f1b_sgd"),
         4: ("pp_fsdp_sgd", "pp_fsdp_adamw", "pp_tp_adamw")}
CHECKS = ("update_equals_one_process_on_the_global_batch", "loss_is_the_batch_mean_on_every_stage",
          "every_stage_gets_the_same_batches", "gather_for_metrics_gives_each_row_once",
          "stage_holds_its_units_by_full_name",
          "stage_is_split_as_the_layout_says", "optimizer_steps_only_the_stage",
          "model_call_is_refused", "indivisible_batch_is_refused", "save_gathers_every_stage_by_name",
          "load_gives_each_stage_its_part", "optimizer_state_saved_by_name_resumes_in_one_plain_process",
          "a_plain_checkpoint_with_optimizer_resumes_on_every_stage",
          "non_finite_loss_stops_every_stage", "a_batch_of_other_shapes_runs_its_own_schedule",
          "clip_grad_norm_clips_to_the_whole_models_norm", "pipeline_forward_gives_the_outputs_on_the_last_stage_only",
          "stages_with_other_param_groups_are_refused_on_every_rank")


class Launches:
    """One torchrun launch per world size, by the first test that needs it."""

    def __init__(self, root) -> None:
        self.root = root
        self._done: Dict[int, Tuple[Result, List[dict]]] = {}

    def get(self, world: int) -> Tuple[Result, List[dict]]:
        if world not in self._done:
            out = self.root / f"world{world}"
            out.mkdir()
            result = launch("torchrun", WORKER, ["--cases", ",".join(CASES[world]), "--out", str(out)], nproc=world,
                            timeout=TIMEOUT, env={"OMP_NUM_THREADS": "1"})
            records = [json.loads(line) for line in result.output.splitlines() if line.startswith('{"case"')]
            self._done[world] = (result, records)
        return self._done[world]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory.mktemp("pipeline"))


def _records(launches: Launches, world: int, case: str) -> List[dict]:
    result, records = launches.get(world)
    result.check()
    mine = [r for r in records if r["case"] == case]
    assert sorted(r["rank"] for r in mine) == list(range(world)), f"missing ranks:\n{result.output[-3000:]}"
    return mine


@pytest.mark.parametrize("world,case", [(w, c) for w, cases in CASES.items() for c in cases])
@pytest.mark.parametrize("check", CHECKS)
def test_pipeline_case(launches, world, case, check):
    for record in _records(launches, world, case):
        assert record["checks"].get(check) == "ok", f"rank {record['rank']}: {record['checks']}"


def test_the_measured_difference_is_far_inside_the_bound(launches):
    """The largest difference over every case and rank, printed for the report (bound 1e-12)."""
    worst = max(r["max_diff"] for world in CASES for case in CASES[world] for r in _records(launches, world, case))
    resumed = max(r["resume_diff"] for world in CASES for case in CASES[world] for r in _records(launches, world, case))
    print(f"pipeline: largest |stage - one process| over every case: {worst:.3g}; "
          f"largest |resumed - uninterrupted| (optimizer state through a checkpoint, both ways): {resumed:.3g}")
    assert worst <= 1e-12 and resumed <= 1e-12


OPERATIONS_BETWEEN_UNITS = """
import torch

import unified_dist as ud


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(5, 6)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(4))
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))  # an operation between units: every stage would run it on what it holds
        return self.head(x)


ud.init(pp=2)
model = ud.prepare(Net())
ud.pipeline_step(model, torch.randn(4, 5), torch.randn(4, 3), torch.nn.functional.mse_loss)
print("the step ran", flush=True)
"""


def test_a_forward_with_operations_between_its_units_is_refused_in_one_line(tmp_path):
    """docs/pipeline.md: every stage runs the model's own forward, its other stages' units replaced by stand-ins that
    return what they are given; a ``torch.tanh`` between two units would run on every stage (4 times where the model
    runs it once per layer before the stage's own, here), a silently different model. The first stage's first
    forward is refused in one line, and the launch ends (the other stage, waiting for it, is stopped by torchrun)."""
    (tmp_path / "train.py").write_text(OPERATIONS_BETWEEN_UNITS)
    result = launch("torchrun", str(tmp_path / "train.py"), nproc=2, timeout=TIMEOUT, env={"OMP_NUM_THREADS": "1"})
    assert not result.timed_out and result.returncode != 0, result.output[-3000:]
    assert "the step ran" not in result.output
    assert ("PipelineError: pp: Net.forward gave unit layers.1 something other than what unit layers.0 returned: "
            "under pp every stage runs the model's forward") in result.output, result.output[-3000:]
