"""bench/suite_time/suite_time.py: the suite's budget sums every phase of every test, and ranks them (figures by
hand)."""
import json

import pytest

from unified_dist.testing.launchers import bench_module


@pytest.fixture(scope="module")
def suite_time():
    return bench_module("bench/suite_time/suite_time")


TIMES = {"commit": "abc1234", "command": "make test", "cpu": "Some CPU", "cores": 2, "wall_s": 130.0,
         "load_before": [1.0, 1.0, 1.0], "load_after": [2.0, 1.5, 1.0], "steal_fraction": 0.01, "exit_status": 1,
         "items": {
             "tests/unit/test_a.py::test_one": {"setup": 0.5, "call": 1.5, "teardown": 0.0, "outcome": "passed"},
             "tests/unit/test_a.py::test_two": {"setup": 0.0, "call": 8.0, "teardown": 0.0, "outcome": "failed"},
             "tests/launchers/test_b.py::test_x[torchrun]": {"setup": 60.0, "call": 20.0, "teardown": 10.0,
                                                              "outcome": "passed"},
         }}


def test_the_budget_is_every_phase_summed_and_ranked(suite_time):
    s = suite_time.summarise(TIMES, slowest=3, files=1)
    # 0.5 + 1.5 + 8 + 60 + 20 + 10 = 100 s of tests
    assert s["tests_s"] == 100.0 and s["tests"] == 3 and s["failed"] == 1
    assert s["budget_s"] == 1800 and s["over_s"] == -1700.0
    assert s["by_phase"] == [{"name": "setup", "s": 60.5, "share": 0.605}, {"name": "call", "s": 29.5, "share": 0.295},
                             {"name": "teardown", "s": 10.0, "share": 0.1}]
    assert s["by_folder"] == [{"name": "tests/launchers", "s": 90.0, "share": 0.9},
                              {"name": "tests/unit", "s": 10.0, "share": 0.1}]
    assert s["by_file"] == [{"name": "tests/launchers/test_b.py", "s": 90.0, "share": 0.9}]
    assert [(r["nodeid"].split("::")[1], r["phase"], r["s"]) for r in s["slowest"]] == [
        ("test_x[torchrun]", "setup", 60.0), ("test_x[torchrun]", "call", 20.0), ("test_x[torchrun]", "teardown", 10.0)]
    assert s["slowest_share"] == 0.9
    assert s["commit"] == "abc1234" and s["cpu"] == "Some CPU" and s["load_before"] == [1.0, 1.0, 1.0]


def test_the_docs_lines_say_the_minutes_and_the_verdict(suite_time):
    over = dict(TIMES, items={"tests/unit/t.py::a": {"call": 2400.0}})
    lines = suite_time.table(suite_time.summarise(over))
    assert "**40.0 min of tests**" in lines[0] and "10.0 min over the budget of 30 min" in lines[0]
    assert lines[-1] == "| `tests/unit/t.py::a` | call | 2400 | 100.0% |"
    under = suite_time.table(suite_time.summarise(TIMES))
    assert "28.3 min under the budget" in under[0]  # 1800 s - 100 s = 1700 s


def test_with_workers_the_budget_is_the_sessions_wall_clock(suite_time):
    """Two xdist workers: their phases overlap, so the budget measures the session's 130 s, not the 100 s summed."""
    s = suite_time.summarise(dict(TIMES, workers=2))
    assert s["workers"] == 2 and s["tests_s"] == 100.0 and s["over_s"] == 130.0 - 1800
    first = suite_time.table(s)[0]
    assert "3 tests on 2 pytest-xdist workers, **2.2 min wall** (1.7 min of test phases summed" in first
    assert "27.8 min under the budget of 30 min" in first  # 1800 s - 130 s = 1670 s


def test_a_file_that_is_not_a_run_is_one_line_and_status_2(suite_time, tmp_path, capsys):
    empty = tmp_path / "t.json"
    empty.write_text(json.dumps({"items": {}}))
    assert suite_time.main([str(empty)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert suite_time.main([str(tmp_path / "missing.json")]) == 2


LAUNCHES = [
    {"test": "tests/launchers/test_b.py::test_x[torchrun]", "launcher": "torchrun", "script": "w.py", "wall_s": 20.0,
     "cpu_s": 36.0, "timed_out": False},
    {"test": "tests/launchers/test_b.py::test_y", "launcher": "torchrun", "script": "w.py", "wall_s": 30.0,
     "cpu_s": 6.0, "timed_out": False},
    {"test": "tests/unit/test_a.py::test_two", "launcher": "mpirun", "script": "v.py", "wall_s": 5.0, "cpu_s": 8.0,
     "timed_out": True},
]


def test_the_launches_are_counted_per_launcher_and_the_longest_ranked(suite_time):
    s = suite_time.launch_summary(LAUNCHES, tests_s=100.0, longest=2)
    # 20 + 30 + 5 = 55 s of wall inside launches, of 100 s of tests; 36 + 6 + 8 = 50 CPU-s
    assert (s["launches"], s["wall_s"], s["cpu_s"], s["share_of_tests"], s["timed_out"]) == (3, 55.0, 50.0, 0.55, 1)
    assert s["by_launcher"] == [
        {"name": "torchrun", "launches": 2, "wall_s": 50.0, "cpu_s": 42.0, "mean_wall_s": 25.0},
        {"name": "mpirun", "launches": 1, "wall_s": 5.0, "cpu_s": 8.0, "mean_wall_s": 5.0}]
    assert [(r["test"].split("::")[1], r["wall_s"], r["cpu_per_wall"]) for r in s["longest"]] == [
        ("test_y", 30.0, 0.2), ("test_x[torchrun]", 20.0, 1.8)]
    lines = suite_time.table(dict(suite_time.summarise(TIMES), launches=s))
    assert "- 3 launches took 0.9 min of wall (55% of the test phases) and 0.8 CPU-min; by launcher: " \
           "torchrun 2 x 25.0 s, mpirun 1 x 5.0 s." in lines
    assert lines[-1] == "| `tests/launchers/test_b.py::test_x[torchrun]` | torchrun | 20 | 36 | 1.8 |"


def test_an_empty_launch_log_is_one_line_and_status_2(suite_time, tmp_path, capsys):
    times = tmp_path / "t.json"
    times.write_text(json.dumps(TIMES))
    log = tmp_path / "launches.jsonl"
    log.write_text("")
    assert suite_time.main([str(times), "--launches", str(log)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_first_line_says_how_busy_the_cores_were_where_the_run_recorded_it(suite_time):
    busy = suite_time.table(suite_time.summarise(dict(TIMES, busy_fraction=0.974)))
    assert busy[0].endswith("under the budget of 30 min. The cores were busy 97% of the run.")
    assert "busy" not in suite_time.table(suite_time.summarise(TIMES))[0]  # an older record: nothing said


def test_a_run_under_a_cpu_quota_says_how_many_times_slower_the_machine_was_made(suite_time):
    s = suite_time.summarise(dict(TIMES, cpu_quota=1.429))
    assert s["cpu_quota"] == 1.429
    assert ("on Some CPU, 2 cores, its CPU time cut to 1.43 CPUs (bench/suite_time/slower.py: this machine made "
            "1.40 times slower)") in suite_time.table(s)[0]  # 2 / 1.429 = 1.3996
    assert "cut" not in suite_time.table(suite_time.summarise(TIMES))[0]
