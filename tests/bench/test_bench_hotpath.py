"""bench/hotpath/hotpath.py (issue #28's benchmark): the recorded results are complete; the script runs in its
smoke mode (seconds of steps; two launches of the facade step and one paired launch) and writes a
well-formed results file; its arithmetic, in process, against hand-computed values."""
import json
from pathlib import Path

import pytest

from unified_dist.testing.launchers import bench_module

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "hotpath" / "results" / "hotpath.json"


@pytest.fixture(scope="module")
def bench():
    return bench_module("bench/hotpath/hotpath")


def check_record(record: dict, repeats: int, backends: list) -> None:
    """Provenance, a compiled and an eager report per repeat with positive step times and the warm-up
    steps apart, the ratios recomputable from them, and a paired row per backend."""
    assert record["commit"] and record["command"] and "steal_fraction" in record and record["load_after"]
    summary = record["eager_vs_compiled"]
    assert len(summary["runs"]) == repeats
    for run in summary["runs"]:
        for variant in ("eager", "compiled"):
            report = run[variant]
            assert report["world_size"] == 2 and report["median_step_s"] > 0 and report["step_times_s"]
            assert len(report["warmup_step_times_s"]) == record["settings"]["warmup"]
    ratios = [r["compiled"]["median_step_s"] / r["eager"]["median_step_s"] for r in summary["runs"]]
    assert summary["compiled_over_eager_per_repeat"] == pytest.approx(ratios)
    assert summary["target"] == 0.85
    assert sorted(record["facade_vs_native"]) == sorted(backends)
    for backend, row in record["facade_vs_native"].items():
        assert row["paired"]["backend"] == backend and row["paired_steps"] == record["settings"]["paired_steps"]
        assert row["ratio"] > 0 and row["target"] == 1.01


def test_the_recorded_results_are_complete():
    """bench/hotpath/results/hotpath.json (what docs/benchmarks/hot-path.md shows): >= 3 repeats, inductor, every
    backend."""
    record = json.loads(RESULTS.read_text())
    assert record["settings"]["repeats"] >= 3 and record["settings"]["compile_backend"] == "inductor"
    assert not record["settings"]["smoke"]
    check_record(record, record["settings"]["repeats"], ["torch", "accelerate", "horovod"])


@pytest.mark.distributed
@pytest.mark.slow
def test_the_smoke_mode_writes_a_well_formed_results_file(bench, tmp_path, tiny_bert):
    """torchrun x 2: the facade step eager and compiled (dynamo's eager backend), then paired facade/native, on
    the tests' BERT."""
    out = tmp_path / "hotpath.json"
    assert bench.main(["--smoke", "--model", tiny_bert, "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    check_record(record, 1, ["torch"])
    assert record["settings"]["smoke"] and record["settings"]["compile_backend"] == "eager"


def test_compile_time_is_the_warmup_beyond_steady_steps(bench):
    assert bench.compile_seconds([30.0, 2.5, 1.5], 1.0) == pytest.approx(31.0)  # 34 s - 3 x 1 s


def test_eager_vs_compiled_pairs_by_repeat(bench):
    def report(step, warmup):
        return {"median_step_s": step, "warmup_step_times_s": warmup}

    runs = [{"eager": report(2.0, [3.0]), "compiled": report(1.0, [41.0])},
            {"eager": report(4.0, [4.0]), "compiled": report(3.0, [33.0])},
            {"eager": report(1.0, [2.0]), "compiled": report(0.9, [20.9])}]
    summary = bench.eager_vs_compiled(runs)
    assert summary["compiled_over_eager_per_repeat"] == pytest.approx([0.5, 0.75, 0.9])
    assert summary["compiled_over_eager"] == pytest.approx(0.75)  # unpaired medians: 1.0 / 2.0 = 0.5
    assert summary["eager_step_s"] == 2.0 and summary["compiled_step_s"] == 1.0
    assert summary["compile_s_per_repeat"] == pytest.approx([40.0, 30.0, 20.0])
    assert summary["eager_warmup_extra_s_per_repeat"] == pytest.approx([1.0, 0.0, 1.0])


def test_facade_vs_native_takes_the_median_paired_ratio(bench):
    paired = {"paired_ratios": [1.0, 1.2, 0.9, 1.1, 1.05], "median_paired_ratio": 1.05,
              "median_step_s": {"facade": 1.1, "native": 1.0}}
    row = bench.facade_vs_native(paired)
    assert row["ratio"] == 1.05 and row["paired_steps"] == 5 and row["facade_step_s"] == 1.1
    assert row["ratio_iqr"][0] <= 1.05 <= row["ratio_iqr"][1]
