"""Preemption under real launchers (issue 29, docs/preemption.md): a stop signal mid-run stops every rank
at one optimizer step, the job checkpoints and leaves, and a relaunch resumes to the uninterrupted run's
weights. The in-process contract is tests/unit/training/test_preemption.py.

One worker (tests/launchers/workers/preempt_worker.py; float64 Linear, AdamW, a prepared map-style loader,
gradient_accumulation_steps=2, ``ud.should_stop()`` after every micro-step) under:

- torchrun x 2, SIGTERM to torchrun; while rank 0 writes the stop checkpoint it gets a second SIGTERM
  halfway through the bytes; then torchrun x 1 resumes (2 ranks -> 1);
- torchrun x 2, a loop that first asks after its third optimizer step: rank 1 sends itself SIGTERM between
  that step and the first ask; the signal is held, and both ranks stop at the next step and exit 75;
- accelerate launch x 2 --max_restarts 1, SIGTERM to rank 1 only: both ranks stop at one step and exit
  75, and the elastic agent runs them again (what exit 75 is for), which resume and finish;
- horovodrun x 2 --gloo, SIGTERM to horovodrun; then horovodrun x 2 resumes;
- a real one-node SLURM (tools/slurm_cluster.sh): ``sbatch --requeue`` a 2-task job, ``scancel --signal=USR1``
  → the job saves, requeues itself (Restarts=1), runs again, resumes and finishes.

No timing races: the test signals once every rank wrote its ready file, and the ranks then wait (a poll
for the files, no timed sleep) until each signalled rank has recorded its signal, so the stop is agreed
at step READY + 1 on any machine.

Every run also counts the backend's collective primitives per micro-step: none on a micro-step that only
accumulates, one (the step's exchange) on each optimizer step. The expected weights come from plain
single-process torch on the same rows, never from the facade.

What the launchers do, as seen here (torch 2.13, accelerate 1.15, horovod 0.28.1):
- torchrun on SIGTERM sends SIGTERM to every worker, waits for them (up to its 30 s shutdown timeout,
  then SIGKILL), and exits 1 re-raising its ``SignalException``; it does not look at the workers' codes.
- accelerate launch runs torch's elastic agent: a worker exiting 75 is a failure ("failed (exitcode: 75)")
  that ``--max_restarts N`` runs again; without restarts it exits 1.
- horovodrun (gloo) on SIGTERM sends SIGTERM to every worker, gives them 5 s
  (``horovod.runner.common.util.safe_shell_exec.GRACEFUL_TERMINATION_TIME_S``), then SIGSTOPs and SIGKILLs
  what is left; it prints each worker's status ("Process 0 exit with status code 75.") and exits 1.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import psutil
import pytest
import torch

from unified_dist.testing.launchers import BIN, ROOT, Result, child_env, command, kill_session, run

sys.path.insert(0, str(ROOT / "tests" / "launchers" / "workers"))
import preempt_worker as worker  # noqa: E402  (its data and sizes; the loop runs in the launched processes)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = "tests/launchers/workers/preempt_worker.py"
TIMEOUT = 150  # a launch takes 10-30 s on 2 cores; collectives time out after 60 s (the worker's init)
READY, TOTAL = 3, 60  # the worker's first checkpoint (then the ready files), and its last optimizer step
ROWS_PER_STEP = 8  # 4 rows per micro-step in all (whatever the world size) x 2 micro-steps


def reference() -> torch.Tensor:
    """The uninterrupted run in plain torch: optimizer step s trains on rows 8s..8s+7 (mod 40) at once."""
    x, y = worker.data()
    weight, bias = worker.initial_weights()
    model = torch.nn.Linear(3, 1).double()
    with torch.no_grad():
        model.weight.copy_(weight)
        model.bias.copy_(bias)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    for step in range(TOTAL):
        rows = slice(step * ROWS_PER_STEP % 40, step * ROWS_PER_STEP % 40 + ROWS_PER_STEP)
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([model.weight.detach().reshape(-1), model.bias.detach()])


def read(out: Path, name: str) -> Optional[dict]:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _kill_leftover_workers(out: Path, tag: str) -> None:
    """Workers whose pids the ready files name and that still run this worker (a launcher that exited
    first may leave them): SIGKILL, by pid."""
    for path in out.glob(f"{tag}_ready_rank*.json"):
        pid = json.loads(path.read_text())["pid"]
        try:
            proc = psutil.Process(pid)
            if any("preempt_worker.py" in part for part in proc.cmdline()):
                proc.kill()
        except psutil.Error:
            pass


def run_and_signal(cmd: List[str], out: Path, tag: str, ranks: int, target: str,
                   sig: int = signal.SIGTERM, env: Optional[Dict[str, str]] = None) -> Result:
    """Start ``cmd``; once every rank wrote its ready file, send ``sig`` to the launcher (``target`` =
    "launcher") or to one rank's pid ("rank1"); wait for the launcher to end (killed after TIMEOUT)."""
    log = out / f"{tag}.log"
    deadline = time.monotonic() + TIMEOUT
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env or child_env(), stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)
    timed_out = False
    try:
        ready = [out / f"{tag}_ready_rank{r}.json" for r in range(ranks)]
        while not all(p.exists() for p in ready) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.exists() for p in ready), f"not every rank got ready:\n{log.read_text()[-3000:]}"
        pid = proc.pid if target == "launcher" else json.loads(ready[int(target[len("rank"):])].read_text())["pid"]
        os.kill(pid, sig)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        if proc.poll() is None:
            kill_session(proc.pid)
            proc.wait()
        _kill_leftover_workers(out, tag)
    return Result(cmd, proc.returncode, log.read_text(), timed_out)


def relaunch(cmd: List[str], out: Path, tag: str) -> Result:
    """Run ``cmd`` to its end (killed after TIMEOUT)."""
    return run(cmd, TIMEOUT)


def args(ck: Path, out: Path, tag: str, *more: str) -> List[str]:
    return ["--dir", str(ck), "--out", str(out), "--tag", tag, *more]


def stopped_together(out: Path, tag: str, ranks: int, output: str) -> int:
    """Every rank reports the same stop step, after the ready checkpoint and before the end; returns it."""
    stops = {r: read(out, f"{tag}_stop_rank{r}") for r in range(ranks)}
    assert all(stops.values()), f"a rank did not stop: {stops}\n{output[-3000:]}"
    steps = {r: s["step"] for r, s in stops.items()}
    assert len(set(steps.values())) == 1, f"ranks stopped at different optimizer steps: {steps}"
    step = steps[0]
    assert step == READY + 1, step  # the ranks waited for the signal after the ready step: the next step stops
    assert all(s["steps_taken"] == step and s["world"] == ranks for s in stops.values()), stops
    return step


def one_exchange_per_optimizer_step(out: Path, tag: str, ranks: int) -> None:
    """The count: backend collective primitives per micro-step, on every rank. A micro-step that only
    accumulates calls none (should_stop() is asked after each); the synchronising one calls one, the
    exchange that carries the stop bit and the non-finite bit together."""
    for r in range(ranks):
        calls = read(out, f"{tag}_calls_rank{r}")
        assert calls, f"rank {r} wrote no counts"
        accumulating = [n for synced, n in calls if not synced]
        synchronising = [n for synced, n in calls if synced]
        assert len(accumulating) == len(synchronising) >= 1, calls
        assert set(accumulating) == {0}, f"rank {r}: collectives on accumulating micro-steps: {calls}"
        assert set(synchronising) == {1}, f"rank {r}: collectives per optimizer step: {calls}"


def checkpoints(ck: Path) -> Dict[int, Path]:
    found = {int(m.group(1)): p for p in ck.iterdir() if (m := re.fullmatch(r"checkpoint-(\d+)\.pt", p.name))}
    leftovers = [p.name for p in ck.iterdir() if p.suffix == ".tmp"]
    assert not leftovers, f"a write was left half done: {leftovers}"
    return found


def finished_like_the_uninterrupted_run(out: Path, tag: str, ranks: int, stop: int, ck: Path, output: str) -> None:
    expected = reference()
    for r in range(ranks):
        done = read(out, f"{tag}_done_rank{r}")
        assert done, f"rank {r} of {tag} did not finish:\n{output[-3000:]}"
        assert done["first_step"] == stop and done["step"] == TOTAL and done["world"] == ranks, done
        assert done["resumed_from"] == str(ck / f"checkpoint-{stop:09d}.pt"), done
        got = torch.tensor(done["weight"] + done["bias"], dtype=torch.float64)
        assert torch.allclose(got, expected, rtol=0, atol=1e-6), (r, got, expected)


@pytest.fixture
def dirs(tmp_path):
    ck, out = tmp_path / "ck", tmp_path / "out"
    ck.mkdir()
    out.mkdir()
    return ck, out


def test_torchrun_sigterm_then_a_second_signal_during_the_save_then_resume_on_one_process(dirs):
    ck, out = dirs
    result = run_and_signal(command("torchrun", WORKER, args(ck, out, "tr", "--wait-for-signal", "0,1",
                                                             "--signal-in-save")), out, "tr", 2, "launcher")
    assert not result.timed_out, result.output[-3000:]
    # torchrun forwards the signal, waits for its workers, and exits 1 with its SignalException
    assert result.returncode == 1, (result.returncode, result.output[-3000:])
    assert "Received 15 death signal, shutting down workers" in result.output, result.output[-3000:]
    assert "SignalException: Process" in result.output
    stop = stopped_together(out, "tr", 2, result.output)
    assert all(read(out, f"tr_stop_rank{r}")["received"] == [signal.SIGTERM] for r in (0, 1))  # forwarded to each
    one_exchange_per_optimizer_step(out, "tr", 2)
    saved = checkpoints(ck)  # no half-written file left
    assert sorted(saved) == [READY, stop], sorted(saved)
    for step, path in saved.items():  # both load, with weights_only (what ud.load uses)
        assert torch.load(path, weights_only=True)["step"] == step
    # the second signal arrived halfway through rank 0's write and was only recorded: the write went on
    marker = read(out, "tr_save_signal")
    assert marker and 0 < marker["written"] < marker["of"], marker
    # (torchrun may signal again while it waits: at least the stop's signal and the one sent mid-write)
    assert len(marker["received"]) >= 2 and set(marker["received"]) == {signal.SIGTERM}, marker
    result = relaunch(command("torchrun", WORKER, args(ck, out, "tr1"), nproc=1), out, "tr1")
    result.check()
    finished_like_the_uninterrupted_run(out, "tr1", 1, stop, ck, result.output)
    one_exchange_per_optimizer_step(out, "tr1", 1)


def test_torchrun_a_signal_to_one_rank_before_the_first_ask_is_held_and_both_stop_at_the_next_step(dirs):
    """The loop asks ud.should_stop() only after its ready checkpoint (optimizer step 3), as a program that
    logs or evaluates first; rank 1 sends itself SIGTERM between that step and its first ask. Held (not the
    default action, which would end rank 1 with -15 and nothing saved), it stops both ranks at step 4:
    both save, and both leave with 75 (docs/preemption.md)."""
    ck, out = dirs
    result = run(command("torchrun", WORKER, args(ck, out, "early", "--first-ask-after-ready",
                                                   "--signal-self-at-ready", "1")), TIMEOUT)
    assert not result.timed_out, result.output[-3000:]
    stop = stopped_together(out, "early", 2, result.output)
    assert read(out, "early_stop_rank0")["received"] == [] and read(out, "early_stop_rank1")["received"] == [
        signal.SIGTERM], result.output[-3000:]
    assert [read(out, f"early_exit_rank{r}")["code"] for r in (0, 1)] == [75, 75], result.output[-3000:]
    assert result.returncode == 1, (result.returncode, result.output[-3000:])  # torchrun: a worker exited 75
    one_exchange_per_optimizer_step(out, "early", 2)
    assert sorted(checkpoints(ck)) == [READY, stop]


def test_accelerate_a_signal_to_one_rank_stops_both_and_max_restarts_runs_them_again(dirs):
    ck, out = dirs
    cmd = command("accelerate", WORKER, args(ck, out, "ac", "--wait-for-signal", "1"))
    cmd[cmd.index("launch") + 1:cmd.index("launch") + 1] = ["--max_restarts", "1"]
    result = run_and_signal(cmd, out, "ac", 2, "rank1")
    assert not result.timed_out, result.output[-3000:]
    stop = stopped_together(out, "ac", 2, result.output)
    assert read(out, "ac_stop_rank0")["received"] == [] and read(out, "ac_stop_rank1")["received"] == [signal.SIGTERM]
    one_exchange_per_optimizer_step(out, "ac", 2)
    # exit 75 (EX_TEMPFAIL) is a failure to the elastic agent: it runs the workers again (restart 1)
    assert re.search(r"failed \(exitcode: 75\) local_rank: [01]", result.output), result.output[-3000:]
    assert result.returncode == 0, (result.returncode, result.output[-3000:])
    assert sorted(checkpoints(ck)) == [READY, stop]
    finished_like_the_uninterrupted_run(out, "ac_r1", 2, stop, ck, result.output)
    one_exchange_per_optimizer_step(out, "ac_r1", 2)


def test_horovodrun_sigterm_then_resume(dirs):
    ck, out = dirs
    result = run_and_signal(command("horovodrun", WORKER, args(ck, out, "hv", "--wait-for-signal", "0,1")),
                            out, "hv", 2, "launcher")
    assert not result.timed_out, result.output[-3000:]
    # within horovodrun's 5 s grace every worker saved and left with status 75, as each records itself
    # (horovodrun's own log of the workers' statuses is not read: after its SIGTERM it sometimes lost it)
    codes = [json.loads((out / f"hv_exit_rank{r}.json").read_text())["code"] for r in range(2)]
    assert codes == [75, 75], (result.returncode, result.output[-3000:])
    assert result.returncode == 1, (result.returncode, result.output[-3000:])
    stop = stopped_together(out, "hv", 2, result.output)
    one_exchange_per_optimizer_step(out, "hv", 2)
    assert sorted(checkpoints(ck)) == [READY, stop]
    result = relaunch(command("horovodrun", WORKER, args(ck, out, "hv2")), out, "hv2")
    result.check()
    finished_like_the_uninterrupted_run(out, "hv2", 2, stop, ck, result.output)


def _scontrol_show(env: Dict[str, str], job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True,
                          timeout=30).stdout


def _wait_for(env: Dict[str, str], job: str, pattern: str, deadline: float) -> str:
    while True:
        shown = _scontrol_show(env, job)
        if re.search(pattern, shown) or time.monotonic() > deadline:
            return shown
        time.sleep(0.5)


def test_slurm_usr1_saves_requeues_the_job_and_the_second_run_resumes(dirs, slurm_cluster):
    ck, out = dirs
    env = child_env(slurm_cluster)
    script = out / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --requeue\n#SBATCH --ntasks=2\n#SBATCH --time=10\n"
                      f"#SBATCH --output={out}/slurm-%j.out\n"
                      f"srun {BIN / 'python'} {WORKER} {' '.join(args(ck, out, 'sl', '--wait-for-signal', '0,1'))}\n")
    submitted = subprocess.run(["sbatch", "--parsable", f"--chdir={ROOT}", str(script)], env=env,
                               capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 2 * TIMEOUT
    try:
        ready = [out / f"sl_ready_rank{r}.json" for r in (0, 1)]
        while not all(p.exists() for p in ready) and time.monotonic() < deadline:
            assert not re.search(r"JobState=(FAILED|CANCELLED|TIMEOUT|COMPLETED)", _scontrol_show(env, job)), \
                _scontrol_show(env, job)
            time.sleep(0.2)
        assert all(p.exists() for p in ready), _scontrol_show(env, job)
        # USR1 to the job steps (srun's tasks), as `#SBATCH --signal=USR1@90` does before the time limit
        subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True, timeout=30)
        # rank 0 ran `scontrol requeue`: the job waits for its BeginTime (about 3 min); start it now
        shown = _wait_for(env, job, r"JobState=(PENDING|COMPLETED|FAILED|CANCELLED|TIMEOUT)", deadline)
        assert "Restarts=1" in shown and "JobState=PENDING" in shown, shown
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True, timeout=30)
        shown = _wait_for(env, job, r"JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)", deadline)
    finally:
        if "JobState=COMPLETED" not in _scontrol_show(env, job):
            subprocess.run(["scancel", job], env=env, timeout=30)
    log = "".join(p.read_text() for p in out.glob("slurm-*.out"))
    assert "JobState=COMPLETED" in shown and "Restarts=1" in shown and "ExitCode=0:0" in shown, shown + log[-3000:]
    stop = stopped_together(out, "sl", 2, log)
    assert all(read(out, f"sl_stop_rank{r}")["received"] == [signal.SIGUSR1] for r in (0, 1))
    one_exchange_per_optimizer_step(out, "sl", 2)
    assert sorted(checkpoints(ck)) == [READY, stop]
    finished_like_the_uninterrupted_run(out, "sl_r1", 2, stop, ck, log)
    assert all(read(out, f"sl_r1_done_rank{r}")["launcher"] == "srun" for r in (0, 1))
