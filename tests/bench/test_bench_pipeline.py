"""bench/pipeline/pipeline_bench.py (issue 61, item 7): the summary it computes from a launch's raw times
(checked on numbers written here, expected values by hand), and the recorded results file: every schedule
and microbatch count measured beside the unpipelined step of the same launch, the stages holding the model
between them."""
import json
from pathlib import Path

import pytest

from unified_dist.testing.launchers import bench_module

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "pipeline" / "results" / "pipeline.json"


@pytest.fixture(scope="module")
def bench():
    return bench_module("bench/pipeline/pipeline_bench")


def test_the_summary_is_medians_ratios_and_bubbles(bench):
    raw = {"model": {"parameters": 100}, "unpipelined_step_s": [2.0, 1.0, 3.0],
           "pipelined": [{"schedule": "gpipe", "microbatches": 4, "step_s": [1.0, 1.5, 0.5],
                          "busy_s_per_rank": [0.5, 0.7], "parameter_bytes_per_rank": [240, 160]}]}
    row = bench.summarise(raw)["configs"][0]
    assert row["step_s_median"] == 1.0 and row["ratio_to_unpipelined"] == 0.5  # medians 1.0 / 2.0
    assert row["bubble_measured"] == pytest.approx(1 - 0.6 / 1.0)  # mean busy 0.6 of the step
    assert row["bubble_theory"] == pytest.approx(1 / 5)  # (P - 1) / (M + P - 1), P = 2, M = 4
    assert row["parameter_share_per_rank"] == [0.6, 0.4]  # of 100 float32 parameters, 400 bytes


def test_the_recorded_results_cover_every_configuration_in_one_launch():
    record = json.loads(RESULTS.read_text())
    assert record["commit"] and record["command"] and "load_before" in record and "load_after" in record
    configs = {(r["schedule"], r["microbatches"]) for r in record["configs"]}
    assert configs == {(s, m) for s in ("gpipe", "1f1b") for m in (2, 4, 8)}
    assert record["unpipelined_step_s_median"] > 0
    for row in record["configs"]:
        assert row["ratio_to_unpipelined"] == pytest.approx(row["step_s_median"] / record["unpipelined_step_s_median"])
        assert sum(row["parameter_share_per_rank"]) == pytest.approx(1.0)  # the stages hold the model once
