"""bench/suite_time/slower.py runs a command in a control group whose CPU quota is cores/FACTOR, and
bench/shared/provenance.py's ``cpu_quota`` reads such a quota back (what ``make test``'s record carries)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from unified_dist.testing.launchers import ROOT, bench_module, unavailable

SLOWER = ROOT / "bench" / "suite_time" / "slower.py"


@pytest.fixture(scope="module")
def provenance():
    return bench_module("bench/shared/provenance")


def test_the_quota_is_the_smallest_along_the_group_and_the_groups_above(provenance, tmp_path):
    cpu = tmp_path / "cpu"
    (cpu / "job" / "step").mkdir(parents=True)
    for folder, quota in ((cpu, "-1"), (cpu / "job", "150000"), (cpu / "job" / "step", "-1")):
        (folder / "cpu.cfs_quota_us").write_text(quota + "\n")
        (folder / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/elsewhere\n1:cpu:/job/step\n0::/\n")
    assert provenance.cpu_quota(str(proc), str(tmp_path)) == 1.5
    (cpu / "job" / "step" / "cpu.cfs_quota_us").write_text("50000\n")
    assert provenance.cpu_quota(str(proc), str(tmp_path)) == 0.5
    proc.write_text("1:cpu:/\n")
    assert provenance.cpu_quota(str(proc), str(tmp_path)) is None  # the root group: no quota


def test_a_cgroup_v2_quota_is_read_from_cpu_max(provenance, tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "job").mkdir()
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "job" / "cpu.max").write_text("142857 100000\n")
    proc = tmp_path / "self-cgroup"
    proc.write_text("0::/job\n")
    assert provenance.cpu_quota(str(proc), str(tmp_path)) == pytest.approx(1.42857)
    proc.write_text("0::/\n")
    assert provenance.cpu_quota(str(proc), str(tmp_path)) is None


def test_the_command_runs_with_cores_over_factor_cpus_and_the_group_goes_away():
    if os.geteuid() != 0:
        unavailable("slower.py makes a control group: root needed")
    code = ("import sys; sys.path.insert(0, 'bench/shared'); import provenance; print(provenance.cpu_quota()); "
            "sys.exit(3)")
    got = subprocess.run([sys.executable, str(SLOWER), "2.5", "--", sys.executable, "-c", code], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    cores = len(os.sched_getaffinity(0))
    assert got.returncode == 3, got.stderr  # the command's own status
    assert float(got.stdout) == pytest.approx(cores / 2.5, abs=1e-5), got.stderr
    group = got.stderr.split("(")[-1].split(")")[0]
    assert "unified_dist_slower_" in group and not Path(group).exists()


@pytest.mark.parametrize("args, says", [(["0.8", "--", "true"], "FACTOR 0.8 would not slow anything down"),
                                        (["1.5"], "no command: give it after --")])
def test_bad_input_is_one_line_and_status_2(args, says):
    got = subprocess.run([sys.executable, str(SLOWER), *args], capture_output=True, text=True, timeout=60)
    assert got.returncode == 2 and got.stderr.count("\n") == 1 and says in got.stderr, got.stderr
