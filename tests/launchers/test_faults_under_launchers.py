"""Hangs become errors, dead ranks end the job, NaN stops every rank: under each real launcher."""
import json
import re
import time

import pytest

from unified_dist.testing.launchers import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
DIST = ["torchrun", "accelerate", "horovodrun"]
WORKER = "tests/launchers/workers/fault_worker.py"


def run(launcher, scenario, tmp_path, timeout=120):
    start = time.monotonic()
    result = launch(launcher, WORKER, [scenario, str(tmp_path)], nproc=2, timeout=timeout)
    ranks = {}
    for r in range(2):
        path = tmp_path / f"rank{r}.json"
        if path.exists():
            ranks[r] = json.loads(path.read_text())
    return result, ranks, time.monotonic() - start


CHECK_MODE = {"torchrun": ("mismatch_ok", "mismatch_op", "mismatch_shape"),
              "accelerate": ("mismatch_op", "mismatch_shape"), "horovodrun": ("mismatch_op", "mismatch_shape")}
"""The check-mode scenarios each launcher runs in one launch, in this order (tests/launchers/workers/fault_worker.py):
a mismatch raises on every rank before the mismatched collective runs, so the next scenario starts on the same group;
the last one's error is left uncaught and ends the job. One launch instead of one per scenario: each costs ~7 s of
imports and rendezvous on 2 cores for well under a second of work."""


@pytest.fixture(scope="module")
def check_mode(tmp_path_factory):
    """``check_mode(launcher)``: the launch of ``CHECK_MODE[launcher]`` (run once) and, per scenario, each rank's
    record."""
    done = {}

    def get(launcher):
        if launcher not in done:
            out = tmp_path_factory.mktemp(f"check-{launcher}")
            scenarios = CHECK_MODE[launcher]
            result = launch(launcher, WORKER, [",".join(scenarios), str(out)], nproc=2, timeout=120)
            done[launcher] = result, {scenario: {r: json.loads((out / f"{scenario}_rank{r}.json").read_text())
                                                 for r in range(2) if (out / f"{scenario}_rank{r}.json").exists()}
                                      for scenario in scenarios}
        return done[launcher]

    return get


def _ended_by_the_last_scenario(result, ranks) -> None:
    """The launch ended, non-zero, and every rank recorded every scenario: the caught mismatches left the group
    usable and the last one's uncaught error ended the job."""
    assert not result.timed_out and result.returncode != 0, result.output[-2000:]
    assert all(sorted(each) == [0, 1] for each in ranks.values()), (ranks, result.output[-2000:])


@pytest.mark.parametrize("launcher", DIST)
def test_check_mode_reports_shape_mismatch_on_every_rank(launcher, check_mode):
    result, scenarios = check_mode(launcher)
    _ended_by_the_last_scenario(result, scenarios)
    ranks = scenarios["mismatch_shape"]
    for r in (0, 1):
        msg = ranks[r]["message"]
        assert ranks[r]["error"] == "CollectiveMismatch", ranks
        assert "rank 0: all_reduce(op=sum) float32(3,)" in msg and "rank 1: all_reduce(op=sum) float32(4,)" in msg, msg
        assert "fault_worker.py:" in msg and "\n" not in msg


@pytest.mark.parametrize("launcher", DIST)
def test_check_mode_reports_different_operations(launcher, check_mode):
    result, scenarios = check_mode(launcher)
    _ended_by_the_last_scenario(result, scenarios)
    ranks = scenarios["mismatch_op"]
    for r in (0, 1):
        assert ranks[r]["error"] == "CollectiveMismatch"
        assert "rank 0: all_gather() float32(2,)" in ranks[r]["message"]
        assert "rank 1: barrier()" in ranks[r]["message"]


def test_check_mode_allows_uneven_all_gather(check_mode):
    result, scenarios = check_mode("torchrun")
    _ended_by_the_last_scenario(result, scenarios)
    ranks = scenarios["mismatch_ok"]
    assert ranks[0]["error"] is None and ranks[1]["error"] is None


@pytest.mark.parametrize("launcher", DIST)
def test_timeout_names_the_collective_and_suggests_check_mode(launcher, tmp_path):
    result, ranks, wall = run(launcher, "timeout", tmp_path)
    assert not result.timed_out and result.returncode != 0
    assert ranks[0]["error"] == "CollectiveTimeout", ranks
    msg = ranks[0]["message"]
    assert "all_reduce timed out after 4s on rank 0" in msg and "UNIFIED_DIST_DEBUG=1" in msg, msg
    assert ranks[0]["elapsed"] < 30
    # issue 46: a barrier, and a shutdown's barrier, time out as the documented CollectiveTimeout too, not a raw
    # RuntimeError of gloo's (not Horovod's shutdown: it aborts the process in its own gloo store)
    shutdown = [] if launcher == "horovodrun" else ["CollectiveTimeout: shutdown timed out after 4s on rank 0"]
    assert ranks[0]["then"] == ["CollectiveTimeout: barrier timed out after 4s on rank 0", *shutdown], ranks[0]
    assert wall < 60, f"job took {wall:.0f}s to end after the timeout"


@pytest.mark.parametrize("launcher", DIST)
def test_a_killed_rank_ends_the_job_in_bounded_time(launcher, tmp_path):
    result, ranks, wall = run(launcher, "rank_dies", tmp_path, timeout=100)
    assert not result.timed_out, result.output[-2000:]
    assert result.returncode != 0
    assert wall < 60, wall
    assert 1 not in ranks  # the killed rank wrote nothing
    # the survivor, blocked in all_reduce, raises ud.PeerLost (docs/faults.md) on every backend
    assert ranks[0]["error"] == "PeerLost", (ranks, result.output[-2000:])
    assert "all_reduce failed on rank 0: a peer process is gone" in ranks[0]["message"], ranks[0]
    assert ranks[0]["elapsed"] < 30, ranks[0]
    # the message sends the user to the launcher's log for the rank that exited first: it must be there
    first_exit = {"horovodrun": r"first process to do so was:\s*Process name: 1\b"}.get(
        launcher, r"failed \(exitcode: -9\) local_rank: 1 ")  # torch's elastic agent (torchrun, accelerate)
    assert re.search(first_exit, result.output), result.output[-2000:]
    # docs/faults.md: under Horovod it is also Horovod's own HorovodInternalError (isinstance, in the worker), so
    # hvd.elastic.run recovers from it
    assert ranks[0]["horovod_internal_error"] is (True if launcher == "horovodrun" else None), ranks[0]


@pytest.mark.parametrize("launcher", DIST)
def test_nan_loss_stops_every_rank_at_the_same_step(launcher, tmp_path):
    result, ranks, _ = run(launcher, "nan_loss", tmp_path)
    assert result.returncode != 0 and not result.timed_out
    for r in (0, 1):
        assert ranks[r]["error"] == "NonFiniteLoss", ranks
        assert "not finite on rank 1 at optimizer step 3" in ranks[r]["message"]


def test_accelerate_without_multi_gpu_is_refused_with_the_right_command(tmp_path):
    from unified_dist.testing.launchers import BIN, child_env, free_port, run as run_cmd

    script = tmp_path / "s.py"
    script.write_text("import unified_dist as ud\nud.init()\nprint('started alone')\n")
    result = run_cmd([str(BIN / "accelerate"), "launch", "--num_processes", "2", "--num_machines", "1",
                      "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
                      str(script)], timeout=120, env=child_env())
    assert result.returncode != 0 and "started alone" not in result.output
    assert "LaunchError: accelerate launch asked for several processes" in result.output
    assert "accelerate launch --multi_gpu --num_processes N" in result.output


def test_half_set_launcher_variables_are_refused(tmp_path):
    import sys

    from unified_dist.testing.launchers import child_env, run as run_cmd

    result = run_cmd([sys.executable, "-c", "import unified_dist as ud; ud.init()"], timeout=60,
                     env=child_env({"WORLD_SIZE": "2", "MASTER_PORT": "29555"}))
    assert result.returncode != 0
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("unified_dist.errors.LaunchError: WORLD_SIZE, MASTER_PORT set but RANK missing"), line
    assert "UNIFIED_DIST_BACKEND=single" in line
