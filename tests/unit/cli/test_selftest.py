"""``unified-dist test``: the built-in self-test passes under every launcher, and a hang fails it."""
import os

import pytest

pytestmark = pytest.mark.distributed
WITHOUT_HOROVOD = os.environ.get("UNIFIED_DIST_WITHOUT_HOROVOD") == "1"  # deliberately left out (make setup)
BACKENDS = ["torch", "accelerate"] + ([] if WITHOUT_HOROVOD else ["horovod"]) + ["deepspeed"]  # DeepSpeed's launcher
CHECKS = ["launch", "init", "identity", "all_reduce_sum", "all_reduce_mean", "all_reduce_max", "all_reduce_min",
          "all_gather_even", "all_gather_uneven", "all_gather_0d", "broadcast_tensor", "broadcast_object",
          "barrier", "gather_for_metrics", "training_step", "dtype_matrix"]


def _table(stdout):
    rows = [line.split() for line in stdout.splitlines() if line and not line.startswith("backend")]
    return {(r[0], r[1]): r[2] for r in rows if len(r) >= 3 and r[0] in ("torch", "accelerate", "horovod", "deepspeed")}


def test_the_self_test_runs_deepspeed_where_the_tests_contract_suite_does_not():
    """``unified-dist test`` (no ``--backend``) runs every installed backend whose record says ``selftest``: DeepSpeed
    among them; the tests' launcher suite (its ``contract`` flag) runs under the other stacks' launchers only."""
    import importlib.util

    from unified_dist.cli.selftest import choose_backends
    from unified_dist.testing.launchers import LAUNCHERS

    chosen = choose_backends(None)
    assert ("deepspeed" in chosen) == (importlib.util.find_spec("deepspeed") is not None), chosen
    assert "deepspeed" not in LAUNCHERS and {"torchrun", "accelerate"} <= set(LAUNCHERS), LAUNCHERS


@pytest.mark.slow
def test_every_installed_backend_passes_with_two_processes(cli):
    choice = ["--backend", ",".join(BACKENDS)] if WITHOUT_HOROVOD else []  # else: the default, every installed one
    result = cli("test", *choice, "--nproc", "2", "--timeout", "150", timeout=480)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    table = _table(result.stdout)
    assert set(table) == {(b, c) for b in BACKENDS for c in CHECKS}, sorted(table)
    assert set(table.values()) == {"pass"}, table
    assert f"{len(table)} of {len(table)} passed" in result.stdout
    assert result.stderr.count("\n+ ") + result.stderr.startswith("+ ") == len(BACKENDS), result.stderr


@pytest.mark.fresh_python  # a fork of the zygote passes checks within the 1 s that a fresh start spends importing
def test_a_launch_past_its_timeout_is_killed_and_fails(cli):
    result = cli("test", "--backend", "torch", "--nproc", "2", "--timeout", "1", timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    table = _table(result.stdout)
    assert table[("torch", "launch")] == "FAIL" and "timed out after 1s (killed)" in result.stdout
    assert "pass" not in table.values()
    assert "failed" in result.stdout.splitlines()[-1]


def test_hung_names_the_check_the_ranks_were_in(tmp_path):
    """docs/cli.md: a launch killed while ranks were inside a check reports `hung` on that check's row
    (rank files as the worker writes them: rank 0 finished init and is still in all_reduce)."""
    import json

    from unified_dist.checks import selftest
    from unified_dist.checks.contract import CHECKS
    first = CHECKS[0].__name__
    for r in range(2):
        checks = {"init": {"status": "pass", "seconds": 0.1}, first: {"status": "running", "seconds": None}}
        (tmp_path / f"rank{r}.json").write_text(json.dumps({"checks": checks}))
    rows = {row.check: row for row in selftest.rows_of("torch", tmp_path, 2, finished=False)}
    assert rows["init"].status == "pass"
    assert rows[first].status == "hung" and "[0, 1] never finished it" in rows[first].detail, rows[first]
    assert rows[CHECKS[1].__name__].status == "not run"


def test_the_checks_find_each_launcher_where_unified_dist_launch_does(tmp_path):
    """checks/ may not import cli/, so it finds launchers itself: the file ``unified-dist launch`` would run
    (this interpreter's bin/ searched first), whatever PATH says."""
    from unified_dist.checks.processes import launcher_path
    from unified_dist.cli import launch

    for backend in launch.BACKENDS:
        for environ in ({"PATH": os.environ.get("PATH", "")}, {"PATH": str(tmp_path)}, {}):
            assert launcher_path(backend, environ) == launch.find_launcher(backend, environ), (backend, environ)
