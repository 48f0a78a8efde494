"""Tests by kind (pyproject.toml's markers): a test that launches processes without the ``distributed``
marker fails (tests/conftest.py watches it with :class:`LaunchWatch`), so ``pytest -m "not distributed"``
stays the in-process tests; and the helpers the tests share stay out of the library."""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unified_dist.testing.launchers import ROOT, LaunchWatch, child_env, is_launcher

# live 3 s: the watch samples every 0.1 s, but on a saturated 2-core machine its thread can miss a
# 1-second pair (seen once while a CI run shared the machine); real launches live longer still
TWO_AT_ONCE = ["sh", "-c", "sleep 3 & sleep 3; wait"]


def test_launcher_command_lines_are_recognised():
    venv = "/venv/bin"
    for cmdline in ([f"{venv}/python", f"{venv}/torchrun", "--standalone", "x.py"],
                    [f"{venv}/python", f"{venv}/accelerate", "launch", "--multi_gpu", "x.py"],
                    [f"{venv}/python", f"{venv}/horovodrun", "-np", "2", "python", "x.py"],
                    ["srun", "-n", "2", "python", "x.py"], ["mpirun", "-np", "2", "python", "x.py"],
                    [f"{venv}/python", "-m", "torch.distributed.launch", "--nproc_per_node", "2", "x.py"]):
        assert is_launcher(cmdline), cmdline
    for cmdline in ([f"{venv}/python", "-c", "print('torchrun')"], [f"{venv}/python", "-m", "unified_dist", "env"],
                    [f"{venv}/python", f"{venv}/accelerate", "env"], ["sleep", "1"], []):
        assert not is_launcher(cmdline), cmdline


def test_one_process_at_a_time_is_not_a_launch():
    with LaunchWatch() as watch:
        for _ in range(2):
            subprocess.run(["sleep", "0.3"], check=True)
    assert watch.launched is None


def test_short_helpers_beside_one_process_are_not_a_launch():
    """One process running short helpers beside itself, one after another (``mkdocs build`` runs ``git`` and
    ``ruff format`` for milliseconds each; tests/docs/test_docs_site.py builds the site): each helper is seen
    beside it (0.3 s > the 0.1 s sampling) but younger than ``min_age`` (1 s), so it is not a launch."""
    with LaunchWatch() as watch:
        with subprocess.Popen(["sleep", "3"]):
            for _ in range(6):
                subprocess.run(["sleep", "0.3"], check=True)
    assert watch.launched is None, watch.launched


@pytest.mark.distributed
def test_two_processes_at_once_are_a_launch():
    with LaunchWatch() as watch:
        subprocess.run(TWO_AT_ONCE, check=True)
    assert watch.launched and watch.launched.startswith("3 processes at once"), watch.launched


@pytest.mark.distributed
def test_a_launcher_is_a_launch_even_alone(tmp_path):
    fake = tmp_path / "torchrun"
    fake.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(1)\n")
    fake.chmod(0o755)
    with LaunchWatch() as watch:
        subprocess.run([str(fake)], check=True)
    assert watch.launched and watch.launched.startswith("a launcher") and "torchrun" in watch.launched


@pytest.mark.distributed
def test_an_unmarked_test_that_launches_fails(pytester):
    """The guard itself, in a session of its own: same conftest, one test marked, one not."""
    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    distributed: launches\n    horovod: horovodrun\n")
    pytester.makepyfile(test_launching=f"""
        import subprocess
        import pytest

        def test_unmarked():
            subprocess.run({TWO_AT_ONCE!r}, check=True)

        @pytest.mark.distributed
        def test_marked():
            subprocess.run({TWO_AT_ONCE!r}, check=True)
    """)
    start = time.monotonic()
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    # 2 or 3: the watch reports at its first look that finds two processes alive for min_age; on a loaded machine
    # the shell's second sleep can be first seen one look (0.1 s) after the first, and then misses that look
    result.stdout.re_match_lines([r".*test_unmarked launched [23] processes at once.*but is not marked distributed.*"])
    assert time.monotonic() - start < 60


LIBRARY_IMPORT = re.compile(r"^\s*(from\s+(unified_dist\.testing|\.+testing)\b|"
                            r"from\s+(unified_dist|\.+)\s+import\s+.*\btesting\b|"
                            r"import\s+unified_dist\.testing)", re.M)


def test_the_library_never_imports_its_test_helpers():
    offenders = [str(path.relative_to(ROOT)) for path in (ROOT / "unified_dist").rglob("*.py")
                 if "testing" not in path.relative_to(ROOT / "unified_dist").parts[:1]
                 and LIBRARY_IMPORT.search(path.read_text())]
    assert not offenders, f"unified_dist.testing is for the tests and bench/ only: {offenders}"
    assert LIBRARY_IMPORT.search("    from unified_dist.testing.launchers import run\n")
    assert LIBRARY_IMPORT.search("from . import facade, testing\n")


@pytest.mark.fresh_python  # a fork of the zygote has torch in memory before its first line
def test_the_helpers_import_no_torch():
    code = ("import sys, unified_dist.testing.launchers, unified_dist.testing.multinode, "
            "unified_dist.testing.replica_runs\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
