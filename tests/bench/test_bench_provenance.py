"""bench/shared/provenance.py and bench/steal/steal_report.py: what every results file records about the machine."""
import json
from pathlib import Path

import pytest

from unified_dist.testing.launchers import bench_module

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    return bench_module(name)


@pytest.fixture(scope="module")
def provenance():
    return _load("bench/shared/provenance")


def test_steal_share_is_stolen_ticks_over_all_ticks(provenance):
    before = [100, 0, 50, 800, 10, 0, 5, 35, 0, 0]
    after = [400, 0, 100, 1300, 10, 0, 5, 185, 0, 0]  # +300 user +50 system +500 idle +150 steal
    assert provenance.steal_fraction(before, after) == pytest.approx(150 / 1000)
    assert provenance.steal_fraction([], after) is None
    assert provenance.steal_fraction(before, before) is None  # no ticks elapsed: unknown, not 0


def test_busy_share_is_every_tick_but_idle_and_iowait_over_all_ticks(provenance):
    before = [100, 0, 50, 800, 10, 0, 5, 35, 0, 0]
    after = [400, 20, 100, 1300, 60, 5, 5, 185, 0, 0]  # +300 user +20 nice +50 system +500 idle +50 iowait +5 irq
    # +150 steal: 1075 ticks, of them 550 idle or waiting for I/O
    assert provenance.busy_fraction(before, after) == pytest.approx(525 / 1075)
    assert provenance.busy_fraction([], after) is None
    assert provenance.busy_fraction(before, before) is None


def test_a_results_record_has_commit_cpu_load_and_steal(provenance):
    record = provenance.finish(provenance.start())
    assert record["commit"] and record["command"]
    assert "native bf16:" in record["cpu"]
    assert len(record["load_before"]) == 3 and len(record["load_after"]) == 3
    assert record["steal_fraction"] is None or 0.0 <= record["steal_fraction"] <= 1.0
    assert record["busy_fraction"] is None or 0.0 <= record["busy_fraction"] <= 1.0


def test_steal_report_windows():
    report = _load("bench/steal/steal_report")
    lines = [f"{t} cpu {100 * k} 0 0 {100 * k} 0 0 0 {50 * k} 0 0" for k, t in enumerate(range(0, 130, 5))]
    shares = report.windows(lines, 60)
    assert shares and all(s == pytest.approx(50 / 250) for _, s in shares)


# written before bench/shared/provenance.py recorded the steal share (2026-11-23); everything since has it
BEFORE_STEAL = {"compression_parity_smoke", "exit_stress_before_fix", "network_tuning", "network_tuning_repeat",
                "exit_stress"}


def test_every_results_file_records_commit_command_load_and_steal():
    """Each results file has the commit, the command and the load around it (the benchmark pages,
    docs/benchmarks/*.md, show them), and the steal share unless it is one of the older files named here."""
    found = [*ROOT.glob("bench/*/results/*.json"), *ROOT.glob("tools/mutants/results/*.json"),
             ROOT / "tools" / "versions" / "versions.json"]  # each benchmark's folder, the mutation runs, the versions
    files = sorted(p for p in found if not p.stem.endswith(("_partial", "_short")))  # git ignores these
    assert len({p.parent for p in files}) > 10
    for path in files:
        record = json.loads(path.read_text())
        assert isinstance(record, dict), path.name
        missing = [key for key in ("commit", "command", "load_before", "load_after") if key not in record]
        assert not missing, f"{path.name} lacks {missing}"
        assert path.stem in BEFORE_STEAL or "steal_fraction" in record, f"{path.name} lacks steal_fraction"
