"""``ud.launch(fn, *args, nproc, backend)`` under all three stacks, the way a notebook uses it.

Each case is a real ``python -c`` session (the function is typed into ``__main__``, as in a
notebook) or a script, run as a subprocess with a timeout. The workers run contract checks of
unified_dist/checks/contract.py (values from arithmetic and a single-process computation)
and rank 0 returns every rank's outcome.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from unified_dist.testing.launchers import BIN, ROOT, child_env, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORK = textwrap.dedent('''
    import json
    import torch
    import unified_dist as ud

    def work(tag, checks):
        from unified_dist.checks.contract import CHECKS, Context
        ud.init()
        outcome = {"tag": tag, "backend": ud.backend_name(), "launcher": ud.launcher(), "rank": ud.rank(),
                   "world_size": ud.world_size(), "sum_of_ones": ud.all_reduce(torch.ones(1), "sum").item()}
        by_name = {check.__name__: check for check in CHECKS}
        for name in checks:
            by_name[name](Context(out=".", world_size=2))  # raises on a wrong value
            outcome[name] = "ok"
        return {"returned_by_rank": ud.rank(), "per_rank": ud.all_gather_object(outcome)}  # differs per rank
''')
CHECKS = ["identity", "all_reduce_sum", "all_reduce_mean", "all_reduce_max", "all_reduce_min", "all_gather_even",
          "all_gather_uneven", "all_gather_0d", "training_step"]


def _python_c(code: str, timeout: float = 180):
    return run([str(BIN / "python"), "-c", code], timeout=timeout, env=child_env(), cwd=ROOT)


@pytest.mark.parametrize("backend", ["torch", "accelerate", "horovod"])
def test_launch_runs_the_function_on_every_rank_and_returns_rank_0s_value(backend):
    code = WORK + f"print('RESULT', json.dumps(ud.launch(work, 'x7', {CHECKS!r}, nproc=2, backend={backend!r})))\n"
    result = _python_c(code).check()
    line = [ln for ln in result.output.splitlines() if ln.startswith("RESULT ")]
    assert line, result.output[-3000:]
    returned = json.loads(line[-1][len("RESULT "):])
    assert returned["returned_by_rank"] == 0, f"ud.launch returned rank {returned['returned_by_rank']}'s value"
    per_rank = returned["per_rank"]
    assert [o["rank"] for o in per_rank] == [0, 1]
    for outcome in per_rank:
        assert outcome["backend"] == backend and outcome["launcher"] == "ud.launch" and outcome["world_size"] == 2
        assert outcome["sum_of_ones"] == 2.0 and outcome["tag"] == "x7"
        assert all(outcome[name] == "ok" for name in CHECKS), outcome


FROM_STDIN = textwrap.dedent('''
    import sys
    import torch
    import unified_dist as ud

    print("SCRIPT_RAN")  # once: the workers must not re-run a script they cannot read

    def square(x):
        return x * x

    def work(k):
        ud.init()
        total = ud.all_reduce(torch.tensor([ud.rank() + 1.0]), "sum").item()
        return ud.all_gather_object([ud.rank(), square(ud.rank()) + k, total])

    print("RESULT", ud.launch(work, 7, nproc=2, backend=sys.argv[1]), __file__)
''')


@pytest.mark.parametrize("backend", ["torch", "horovod"])  # accelerate starts its workers as torch does
def test_launch_works_from_a_script_read_on_standard_input(backend, tmp_path):
    """``python - <<EOF``: ``__main__.__file__`` is ``<stdin>``, which ``spawn``-ed children cannot re-run."""
    script = tmp_path / "typed.py"
    script.write_text(FROM_STDIN)
    cmd = ["sh", "-c", 'exec "$0" - "$1" < "$2"', str(BIN / "python"), backend, str(script)]
    result = run(cmd, timeout=180, env=child_env(), cwd=ROOT).check()
    line = [ln for ln in result.output.splitlines() if ln.startswith("RESULT ")]
    assert line, result.output[-3000:]
    expected = [[rank, rank * rank + 7, float(sum(r + 1 for r in range(2)))] for rank in range(2)]
    assert line[-1] == f"RESULT {expected} <stdin>", result.output[-3000:]  # __file__ is back afterwards
    assert result.output.count("SCRIPT_RAN") == 1, result.output[-3000:]


FAILING = textwrap.dedent('''
    import time
    import torch
    import unified_dist as ud

    def work():
        ud.init()
        if ud.rank() == 1:
            raise ValueError("bad batch on purpose")
        ud.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that is gone
        time.sleep(600)

    if __name__ == "__main__":
        start = time.monotonic()
        try:
            ud.launch(work, nproc=2, backend=BACKEND)
        except ud.WorkerFailed as exc:
            cause = exc.__cause__
            print("CAUGHT", exc.rank, "|", exc, "|", "work" in exc.remote_traceback,
                  "|", "raise ValueError" in str(cause), "|", round(time.monotonic() - start))
''')


@pytest.mark.parametrize("backend", ["torch", "accelerate", "horovod"])
def test_an_exception_in_a_worker_is_raised_in_the_caller_with_its_traceback(backend, tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING.replace("BACKEND", repr(backend)))
    result = run([str(BIN / "python"), str(script)], timeout=180, env=child_env(), cwd=ROOT).check()
    line = [ln for ln in result.output.splitlines() if ln.startswith("CAUGHT ")]
    assert line, result.output[-3000:]
    rank, message, names_fn, cause_has_line, seconds = [p.strip() for p in line[-1][len("CAUGHT "):].split("|")]
    assert rank == "1" and message == "rank 1 raised ValueError: bad batch on purpose", line
    assert names_fn == "True" and cause_has_line == "True", line
    assert int(seconds) < 120, "the other worker was not stopped"


def test_bad_arguments_are_one_line_errors():
    import unified_dist as ud

    with pytest.raises(ud.UnifiedDistError, match="choose one of torch, accelerate, horovod"):
        ud.launch(print, backend="single")
    with pytest.raises(ud.UnifiedDistError, match="integer >= 1"):
        ud.launch(print, nproc=0)
