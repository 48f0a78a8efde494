"""unified_dist.horovod (horovod.torch's API) under real launchers, and its refusals in-process.

tests/launchers/workers/hvd_compat_worker.py is an unmodified-Horovod-style script (``import horovod.torch as hvd``)
run with unified_dist.horovod.redirect's directory first on PYTHONPATH: under torchrun × 2 that import is
unified_dist.horovod; under horovodrun × 2 the shim steps aside and it is real Horovod. Each launcher runs
once per session (the ``runs`` fixture); every check of the worker is one test item per launcher, its
expected values computed from plain torch arithmetic on the known per-rank inputs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict

import pytest

from unified_dist.testing.launchers import ROOT, launch

sys.path.insert(0, str(ROOT / "tests" / "launchers" / "workers"))

WORKER = "tests/launchers/workers/hvd_compat_worker.py"
LAUNCHERS = ("torchrun", "horovodrun")


def _check_names():
    import ast

    tree = ast.parse((ROOT / WORKER).read_text())
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and any(getattr(d, "id", None) == "check" for d in node.decorator_list)]


CHECKS = _check_names()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each launcher's per-rank results, launched on first use."""
    cache: Dict[str, Dict[int, dict]] = {}

    def get(launcher: str) -> Dict[int, dict]:
        if launcher not in cache:
            from unified_dist.horovod.redirect import pythonpath

            out = tmp_path_factory.mktemp(f"hvd_{launcher}")
            env = {"PYTHONPATH": pythonpath({"PYTHONPATH": str(ROOT)}), "EXPECTED_SIZE": "2",
                   "HOROVOD_DYNAMIC_PROCESS_SETS": "1"}  # real Horovod adds process sets after init only then
            result = launch(launcher, WORKER, ["--out", str(out)], nproc=2, timeout=180, env=env)
            result.check()
            cache[launcher] = {r: json.loads((out / f"hvd_rank{r}.json").read_text()) for r in range(2)}
        return cache[launcher]
    return get


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("name", CHECKS)
def test_hvd_check_under_launcher(runs, launcher, name):
    for rank, results in runs(launcher).items():
        assert name in results, f"rank {rank} under {launcher} did not run {name}"
        assert results[name] == "ok", f"rank {rank} under {launcher}: {name}: {results[name]}"


# ---------------------------------------------------------------------- refusals, in-process
def test_adasum_is_refused_with_the_alternative():
    from unified_dist.horovod import _ops

    with pytest.raises(_ops.NotOffHorovod, match="op=hvd.Average"):
        _ops.resolve_op(_ops.Adasum, None)


def test_average_and_op_together_are_refused_as_horovod_does():
    from unified_dist.horovod import _ops

    with pytest.raises(ValueError, match="supersedes average"):
        _ops.resolve_op(_ops.Sum, True)
    assert _ops.resolve_op(None, False) == _ops.Sum and _ops.resolve_op(None, None) == _ops.Average


def test_timeline_and_mpi_communicators_are_refused():
    import unified_dist.horovod as hvd
    from unified_dist.horovod import _ops, _topology

    with pytest.raises(_ops.NotOffHorovod, match="torch.profiler"):
        hvd.start_timeline("/tmp/timeline.json")
    with pytest.raises(_ops.NotOffHorovod, match=r"ProcessSet\(\[0, 1\]\)"):
        hvd.ProcessSet(object())
    with pytest.raises(_ops.NotOffHorovod, match="ProcessSet"):
        _topology.init(comm=object())


def test_queries_before_init_say_to_call_init():
    from unified_dist.horovod import _topology

    with pytest.raises(ValueError, match=r"use hvd.init\(\)"):
        _topology.size()


def test_unknown_names_are_attribute_errors():
    import unified_dist.horovod as hvd

    with pytest.raises(AttributeError, match="horovod-migration"):
        hvd.no_such_name  # noqa: B018


def test_distributed_optimizer_refuses_what_horovod_refuses():
    import torch

    from unified_dist.horovod import _optimizer

    model = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="backward_passes_per_step must be > 0"):
        _optimizer.DistributedOptimizer(sgd, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="op != Average"):
        _optimizer.DistributedOptimizer(sgd, op=1, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="duplicates: w"):
        _optimizer.DistributedOptimizer(sgd, named_parameters=[("w", model.weight), ("w", model.bias)])
    with pytest.raises(ValueError, match="not named"):
        _optimizer.DistributedOptimizer(sgd, named_parameters=[("w", model.weight)])


def test_reducescatter_rows_give_the_first_ranks_the_remainder():
    from unified_dist.horovod._ops import reducescatter_rows

    assert [reducescatter_rows(7, 3, i) for i in range(3)] == [(0, 3), (3, 2), (5, 2)]
    assert [reducescatter_rows(2, 4, i) for i in range(4)] == [(0, 1), (1, 1), (2, 0), (2, 0)]


def test_the_shim_directory_answers_for_horovod_torch():
    from unified_dist.horovod.redirect import SHIM_DIR, pythonpath

    assert Path(SHIM_DIR, "horovod", "__init__.py").is_file()
    assert Path(SHIM_DIR, "horovod", "torch", "__init__.py").is_file()
    assert pythonpath({"PYTHONPATH": "/x"}).split(":")[0] == SHIM_DIR


def test_launch_horovod_api_puts_the_shim_first():
    from unified_dist.cli.launch import Plan, build, with_horovod_api
    from unified_dist.horovod.redirect import SHIM_DIR

    command = with_horovod_api(build(Plan(backend="torch", script="train.py", nproc=2)), {"PYTHONPATH": "/mine"})
    parts = command.env["PYTHONPATH"].split(":")
    assert parts[0] == SHIM_DIR and parts[-1] == "/mine"
    assert command.argv[0] == "torchrun"


def test_a_name_is_refused_while_queued_and_free_once_its_operation_ran():
    from unified_dist.horovod import _ops

    pending = _ops._Pending([], None, "grad.w", _ops._one)
    _ops._in_flight["grad.w"] = pending
    try:
        assert pending.queued
        with pytest.raises(ValueError, match="'grad.w' is still in flight"):
            _ops._claim("grad.w")
        pending.start([(None, lambda: "done")])  # the ranks agreed and ran it
        assert not pending.queued and pending.finish() == "done"
        _ops._claim("grad.w")  # free again, before anyone synchronized it (Horovod frees it when it runs)
    finally:
        _ops._in_flight.pop("grad.w", None)
    assert _ops.synchronize(10 ** 9) is None  # an unknown handle, as in Horovod


def test_polling_a_queued_named_operation_past_the_timeout_says_to_synchronize(monkeypatch):
    import datetime

    from unified_dist.horovod import _ops

    pending = _ops._Pending([], None, "grad.w", _ops._one)
    monkeypatch.setitem(_ops._handles, 7, pending)
    monkeypatch.setattr(_ops._world, "timeout", datetime.timedelta(seconds=30))
    clock = iter([100.0, 120.0, 131.0])
    monkeypatch.setattr(_ops.time, "monotonic", lambda: next(clock))
    assert _ops.poll(7) is False and _ops.poll(7) is False  # queued: not started, within the timeout
    with pytest.raises(_ops.HorovodInternalError, match=r"'grad.w'.*call hvd.synchronize\(handle\)"):
        _ops.poll(7)
