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
                          "busy_s_per_rank": [0.5, 0.7], "parameter_bytes_per_rank": [240, 160],
                          "activation_peak_bytes_per_rank": [800, 640]},
                         {"schedule": "1f1b", "microbatches": 4, "step_s": [1.0], "busy_s_per_rank": [0.5, 0.5],
                          "parameter_bytes_per_rank": [240, 160], "activation_peak_bytes_per_rank": [400, 160]}]}
    row, other = bench.summarise(raw)["configs"]
    assert row["step_s_median"] == 1.0 and row["ratio_to_unpipelined"] == 0.5  # medians 1.0 / 2.0
    assert row["bubble_measured"] == pytest.approx(1 - 0.6 / 1.0)  # mean busy 0.6 of the step
    assert row["bubble_theory"] == pytest.approx(1 / 5)  # (P - 1) / (M + P - 1), P = 2, M = 4
    assert row["parameter_share_per_rank"] == [0.6, 0.4]  # of 100 float32 parameters, 400 bytes
    assert row["activation_peak_vs_gpipe_per_rank"] == [1.0, 1.0] and row["activation_peak_vs_gpipe_theory"] == [1, 1]
    assert other["activation_peak_vs_gpipe_per_rank"] == [0.5, 0.25]  # 400 / 800, 160 / 640
    # 1F1B's warm-up: stage 0 holds min(4, 2 - 0) = 2 of the 4 microbatches, stage 1 min(4, 2 - 1) = 1
    assert other["activation_peak_vs_gpipe_theory"] == [0.5, 0.25]


def test_the_recorded_results_cover_every_configuration_in_one_launch():
    record = json.loads(RESULTS.read_text())
    assert record["commit"] and record["command"] and "load_before" in record and "load_after" in record
    configs = {(r["schedule"], r["microbatches"]) for r in record["configs"]}
    assert configs == {(s, m) for s in ("gpipe", "1f1b") for m in (2, 4, 8)}
    assert record["unpipelined_step_s_median"] > 0
    for row in record["configs"]:
        assert row["ratio_to_unpipelined"] == pytest.approx(row["step_s_median"] / record["unpipelined_step_s_median"])
        assert sum(row["parameter_share_per_rank"]) == pytest.approx(1.0)  # the stages hold the model once


def test_1f1b_holds_the_activations_of_the_microbatches_its_warm_up_keeps_in_flight():
    """docs/pipeline.md: at the same microbatch count M, each rank's peak of activations held for backward under
    1F1B is GPipe's times min(M, P - stage) / M (GPipe holds all M microbatches' activations before its first
    backward; 1F1B at most its warm-up's): measured, to the byte, at M = 2, 4 and 8 on both stages. GPipe's
    peak is the same at every M (the global batch is the same, cut finer) but for 4 bytes per microbatch on the last
    stage (a 0-dim float32 its loss saves for each microbatch: measured 3642880 + 4 M). No activation outlives the
    step."""
    record = json.loads(RESULTS.read_text())
    rows = {(r["schedule"], r["microbatches"]): r for r in record["configs"]}
    for m in (2, 4, 8):
        peaks = rows[("1f1b", m)]["activation_peak_bytes_per_rank"]
        gpipe = rows[("gpipe", m)]["activation_peak_bytes_per_rank"]
        assert [a * m for a in peaks] == [g * min(m, 2 - stage) for stage, g in enumerate(gpipe)], (m, peaks, gpipe)
        at_2 = rows[("gpipe", 2)]["activation_peak_bytes_per_rank"]
        assert all(0 <= g - g2 <= 4 * (m - 2) for g, g2 in zip(gpipe, at_2)), (m, gpipe, at_2)
        assert min(gpipe) > 0
    assert all(r["activation_bytes_after_step_per_rank"] == [0, 0] for r in record["configs"])
    for row in record["configs"]:  # the recorded ratios are the file's own theory column too
        assert row["activation_peak_vs_gpipe_per_rank"] == row["activation_peak_vs_gpipe_theory"], row
