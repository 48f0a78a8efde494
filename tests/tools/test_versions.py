"""tools/versions/versions.py, the version matrix (issue #52): its results file, the page rendered from it, and the
parsing that turns a cell's logs into counts and first error lines (no environment is built here)."""
import json
import re
from pathlib import Path

import pytest

from unified_dist.testing.launchers import bench_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def versions():
    return bench_module("tools/versions/versions")


def test_the_page_is_the_results_file_rendered(versions):
    """docs/versions.md is exactly ``python tools/versions/versions.py --render``'s output (rerun it after a cell)."""
    assert (ROOT / "docs" / "versions.md").read_text() == versions.render()


def test_every_row_has_the_fields_the_issue_asks_for():
    results = json.loads((ROOT / "tools" / "versions" / "versions.json").read_text())
    assert results["rows"]
    for row in results["rows"]:
        missing = [k for k in ("python", "torch", "accelerate", "transformers", "datasets", "horovod", "passed",
                               "failed", "failures", "command", "commit", "seconds", "venv_bytes") if k not in row]
        assert not missing, f"{row['python']} × {row['torch']} lacks {missing}"
        assert row["horovod"] == "built" or row["horovod"].startswith("not built: ")
        assert len(row["failures"]) == min(row["failed"], 20)


def test_a_cells_row_replaces_the_row_of_the_same_python_and_torch(versions, tmp_path, monkeypatch):
    monkeypatch.setattr(versions, "RESULTS", tmp_path / "versions.json")
    record = versions.provenance.start()
    for python, torch, passed in (("3.12.1", "2.15.0", 1), ("3.11.7", "2.6.0", 2), ("3.12.1", "2.15.0", 3)):
        versions.save_row({"python": python, "torch": torch, "passed": passed, "commit": "abc1234"}, record)
    saved = json.loads((tmp_path / "versions.json").read_text())
    assert [(r["python"], r["torch"], r["passed"]) for r in saved["rows"]] == [("3.11.7", "2.6.0", 2),
                                                                              ("3.12.1", "2.15.0", 3)]
    assert all(key in saved for key in ("commit", "command", "load_before", "load_after", "steal_fraction"))


def test_the_first_error_is_the_compilers_or_cmakes_not_pips_summary(versions):
    log = """  error: subprocess-exited-with-error
  × Building wheel for horovod (pyproject.toml) did not run successfully.
      -- Found Pytorch: 2.15.0+cu132
      CMake Error at /usr/share/cmake-3.25/Modules/FindPackageHandleStandardArgs.cmake:230 (message):
        Could NOT find CUDAToolkit (missing: CUDAToolkit_INCLUDE_DIR CUDA_CUDART)
      subprocess.CalledProcessError: Command '['cmake', ...]' returned non-zero exit status 1.
  ERROR: Failed building wheel for horovod"""
    assert versions.first_error(log) == ("CMake Error: Could NOT find CUDAToolkit (missing: CUDAToolkit_INCLUDE_DIR "
                                         "CUDA_CUDART)")
    compiler = "x.h:3:2: error: #error C++17 or later compatible compiler is required to use PyTorch.\nERROR: x"
    assert versions.first_error(compiler).startswith("x.h:3:2: error: #error C++17")
    assert versions.first_error("") == "no output"


def test_the_contract_table_is_read_row_by_row(versions):
    table = ["torch       all_reduce_sum      pass         0.01",
             "horovod     launch              FAIL        12.00  horovodrun, 2 processes: exit status 1",
             "horovod     barrier             not run         -  ranks [0, 1] wrote no results"]
    rows = [versions.ROW.match(line).groups() for line in table]
    assert rows == [("torch", "all_reduce_sum", "pass", ""),
                    ("horovod", "launch", "FAIL", "horovodrun, 2 processes: exit status 1"),
                    ("horovod", "barrier", "not run", "ranks [0, 1] wrote no results")]


def test_make_versions_runs_the_matrix_and_make_test_does_not():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^versions: setup\n\t\$\(PY\) tools/versions/versions\.py$", makefile, re.M)
    test_target = re.search(r"^test:.*?\n\n", makefile, re.M | re.S).group(0)
    assert "versions" not in test_target


def test_a_failed_tests_line_names_the_exception_its_launched_processes_raised(versions):
    text = """    def test_reshard(run):
>       assert result.code == 0, result
E       AssertionError: exit 1: /home/u/.cache/unified_dist/versions/3.11.7-torch2.6.0/bin/torchrun --nproc_per_node=4
E       [rank3]:     all_gather_event = all_gather_stream.record_event()
E       [rank3]: AttributeError: 'Stream' object has no attribute 'record_event'
E       torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
unified_dist/testing/launchers.py:110: AssertionError"""
    line = versions.failure_line("AssertionError: exit 1: /home/u/.cache/unified_dist/versions/3.11.7-torch2.6.0/"
                                 "bin/torchrun --nproc_per_node=4", text)
    assert line == ("unified_dist/testing/launchers.py:110: AssertionError | AttributeError: 'Stream' object has no "
                    "attribute 'record_event' | AssertionError: exit 1: $VENV/bin/torchrun --nproc_per_node=4")


def test_setup_cfg_declares_exactly_the_oldest_passing_cells_and_the_readme_says_so(versions):
    """Declared = tested (issue #52): setup.cfg's torch and Python lower bounds are the oldest cells with no
    failure, no failing cell lies inside them, and the README's "Supported versions" line is rendered from them."""
    rows = json.loads((ROOT / "tools" / "versions" / "versions.json").read_text())["rows"]
    bounds = versions.declared(rows)
    setup = (ROOT / "setup.cfg").read_text()
    assert re.search(rf"^python_requires = >={re.escape(bounds['python'])}$", setup, re.M), bounds
    assert re.search(rf"^    torch>={re.escape(bounds['torch'])}$", setup, re.M), bounds
    assert versions.supported_line(rows) in (ROOT / "README.md").read_text()


def test_a_failing_cell_inside_the_declared_bounds_is_refused(versions):
    rows = [{"python": "3.11.7", "torch": "2.8.0", "passed": 5, "failed": 0},
            {"python": "3.11.7", "torch": "2.10.0", "passed": 4, "failed": 1},
            {"python": "3.12.1", "torch": "2.15.0", "passed": 5, "failed": 0}]
    with pytest.raises(ValueError, match="3.11.7 x torch 2.10.0"):
        versions.declared(rows)
    rows[1]["torch"] = "2.6.0"  # an older failing cell stays below the bound
    assert versions.declared(rows) == {"torch": "2.8.0", "python": "3.11", "newest_torch": "2.15.0",
                                       "pythons": "3.11, 3.12"}
