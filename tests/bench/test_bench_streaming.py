"""bench/streaming/streaming.py (issue #27's benchmark): the recorded results are complete and their bytes add up;
the script runs in a tiny configuration (both launches, every configuration) and writes a well-formed
results file; its arithmetic and the worker's filter of what counts as a read, in process."""
import json
import sys
from pathlib import Path

import pytest

from unified_dist.testing.launchers import bench_module

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "streaming" / "results" / "streaming.json"
# (processes, configuration) rows the benchmark writes, written out here
EXPECTED_ROWS = [(1, "map"), (1, "stream"), (1, "stream-shuffled"),
                 (2, "map"), (2, "stream"), (2, "stream-shuffled"), (2, "stream-2-shards")]
HEADER = len("text,label\r\n")  # each CSV file repeats the header line (csv.writer ends lines with \r\n)


@pytest.fixture(scope="module")
def bench():
    return bench_module("bench/streaming/streaming")


def _row(record, nproc, config):
    rows = [r for r in record["rows"] if (r["processes"], r["config"]) == (nproc, config)]
    assert len(rows) == 1, (nproc, config, len(rows))
    return rows[0]


def check_record(record: dict, repeats: int) -> None:
    """What any results file of the script holds: provenance, both launches, a row per configuration with
    positive speeds over every repeat, no bytes for map-style, the whole file on each rank of a one-file
    stream, and each rank its own file of a two-file stream, the two adding up to the one file plus a
    second header line."""
    assert record["commit"] and record["command"] and "steal_fraction" in record
    assert len(record["launches"]) == 2 and "torchrun --standalone --nproc_per_node 2" in record["launches"][1]
    assert [(r["processes"], r["config"]) for r in record["rows"]] == EXPECTED_ROWS
    assert len(record["runs"]) == repeats * len(EXPECTED_ROWS)
    for r in record["rows"]:
        assert r["repeats"] == repeats and r["loop_samples_per_s"] > 0 and r["step_samples_per_s"] > 0, r
        assert len(r["bytes_per_rank"]) == r["processes"]
        assert len(r["data_only_samples_per_s_runs"]) == repeats and r["data_only_samples_per_s"] > 0, r
        assert (r["config"] == "map") == ("loop_vs_map" not in r) == ("best_vs_map" not in r), r
        assert r["loop_samples_per_s_best"] == max(r["loop_samples_per_s_runs"]) >= r["loop_samples_per_s"]
    for nproc in (1, 2):
        assert _row(record, nproc, "map")["bytes_per_rank"] == [0] * nproc
        whole = _row(record, nproc, "stream")
        assert len(set(whole["bytes_per_rank"])) == 1 and whole["bytes_per_rank"][0] > 0
        assert whole["files_per_rank"] == [whole["files_per_rank"][0]] * nproc and len(whole["files_per_rank"][0]) == 1
        assert _row(record, nproc, "stream-shuffled")["bytes_per_rank"] == whole["bytes_per_rank"]
    split, whole = _row(record, 2, "stream-2-shards"), _row(record, 2, "stream")
    files = [names[0] for names in split["files_per_rank"]]
    assert [len(names) for names in split["files_per_rank"]] == [1, 1] and files[0] != files[1]
    assert sum(split["bytes_per_rank"]) == whole["bytes_per_rank"][0] + HEADER
    assert split["opens_per_rank_per_run"] == [1, 1]
    ratio = max(split["bytes_per_rank"]) / max(whole["bytes_per_rank"])
    assert record["summary"]["bytes_per_rank_2_shards_over_1_shard"] == pytest.approx(ratio)


def test_the_recorded_results_are_complete_and_add_up():
    """bench/streaming/results/streaming.json (what docs/benchmarks/streaming.md shows): every row, 3 repeats, and
    two shards halve what each of two ranks reads (the halves differ by a few bytes of text)."""
    record = json.loads(RESULTS.read_text())
    check_record(record, repeats=record["settings"]["repeats"])
    assert record["settings"]["repeats"] >= 3
    assert 0.45 < record["summary"]["bytes_per_rank_2_shards_over_1_shard"] < 0.55


@pytest.mark.distributed
@pytest.mark.slow
def test_the_script_runs_tiny_and_writes_a_well_formed_results_file(bench, monkeypatch, tmp_path, tiny_bert):
    """Both launches (python, torchrun x 2), every configuration, 16 rows of batches of 4, one repeat, the tests'
    BERT."""
    out = tmp_path / "streaming.json"
    monkeypatch.setattr(sys, "argv", ["streaming.py", "--rows", "16", "--batch-size", "4", "--max-length", "16",
                                      "--eval-rows", "8", "--repeats", "1", "--model", tiny_bert, "--out", str(out)])
    assert bench.main() == 0
    record = json.loads(out.read_text())
    check_record(record, repeats=1)
    assert record["settings"] == {"rows": 16, "batch_size": 4, "max_length": 16, "eval_rows": 8, "repeats": 1,
                                  "model": tiny_bert}


def test_speeds_are_rows_over_summed_step_times_and_the_median_step(bench):
    metrics = [{"type": "train", "samples_per_s": 10.0}, {"type": "eval"}, {"type": "train", "samples_per_s": 20.0},
               {"type": "train", "samples_per_s": 40.0}]
    # 3 steps of 4 examples: 0.4 s + 0.2 s + 0.1 s
    assert bench.speeds(metrics, 4, 12) == {"loop": pytest.approx(12 / 0.7), "step": 20.0}
    with pytest.raises(RuntimeError):
        bench.speeds(metrics, 4, 16)  # a step missing from the log


def test_ratios_to_map_style_are_paired_by_seed(bench):
    loops = {("map", 0): 10.0, ("stream", 0): 5.0, ("map", 1): 20.0, ("stream", 1): 18.0, ("map", 2): 4.0,
             ("stream", 2): 3.0}
    runs = [{"config": c, "seed": s, "loop": loop, "step": 1.0} for (c, s), loop in loops.items()]
    reads = [{"name": f"{c}/{s}", "opened": [], "bytes": 0, "data_only": {"examples": 12, "seconds": 0.1 * (s + 1)}}
             for s in range(3) for c in ("map", "stream")]
    rows = bench.rows_of(1, ("map", "stream"), runs, [reads])
    assert rows[0]["data_only_samples_per_s_runs"] == pytest.approx([120, 60, 40])
    assert rows[0]["loop_samples_per_s"] == 10.0 and "loop_vs_map" not in rows[0]
    assert rows[1]["loop_vs_map"] == pytest.approx(0.75)  # median of 0.5, 0.9, 0.75 (unpaired: 5 / 10 = 0.5)
    assert rows[1]["loop_samples_per_s_best"] == 18.0 and rows[1]["best_vs_map"] == pytest.approx(18 / 20)


def test_loader_alone_counts_every_ranks_examples_over_the_slowest_rank(bench):
    # rank 0: 6 examples in 0.1 s, rank 1: 5 examples in 0.2 s -> 11 examples in 0.2 s
    reads = [[{"data_only": {"examples": 6, "seconds": 0.1}}], [{"data_only": {"examples": 5, "seconds": 0.2}}]]
    assert bench.data_only(reads, 2) == [pytest.approx(55.0)]


def test_the_worker_counts_reads_of_the_training_csv_only():
    worker = bench_module("bench/streaming/streaming_worker")
    assert worker.is_training_csv_read("/c/train-0a1b-00000-of-00002.csv", "r")
    assert worker.is_training_csv_read(b"/c/train-0a1b-00000-of-00001.csv", "rb")
    assert not worker.is_training_csv_read("/c/train-0a1b-00000-of-00001.csv.tmp12", "w")  # rank 0 writing it
    assert not worker.is_training_csv_read("/c/train-0a1b-00000-of-00001.csv", "w")
    assert not worker.is_training_csv_read("/c/validation-0a1b.arrow", "rb")
    assert not worker.is_training_csv_read(3, "r")  # a file descriptor
