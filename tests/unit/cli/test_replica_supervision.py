"""Issue #58, the launcher's side: ``unified-dist launch --replica-groups`` supervises what it starts.

Each decision is tested here on small stand-ins (groups that are ``python -c`` one-liners, the real lighthouse
process, which starts in a fraction of a second); tests/launchers/test_replica_groups_supervision.py runs them
under the real launcher with torchft groups.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from unified_dist.cli import replica_child, replicas
from unified_dist.cli.errors import UsageError
from unified_dist.cli.launch import Command

pytestmark = pytest.mark.distributed  # stand-in groups and the lighthouse: several processes at once

def group(index: int, code: str, tmp_path: Path, nproc: int = 1) -> replicas.Group:
    """A stand-in group: ``python -c code`` with the variables and the status folder the launcher gives."""
    command = Command((sys.executable, "-c", code))
    return replicas.Group(index, command, replicas.group_env(command, index, 2, "http://x"), nproc=nproc,
                          status_root=tmp_path / "status")


RECORDS = ("import json, os, pathlib, sys, time\n"
           "folder = pathlib.Path(os.environ['REPLICA_GROUP_STATUS_DIR'])\n"
           "def leave(code, usage=False):\n"
           "    (folder / 'rank0.json').write_text(json.dumps({'code': code, 'usage': usage})); sys.exit(1)\n")
"""What each stand-in group starts with: ``leave(code)`` records ``code`` and exits 1, as torchrun would."""


def watch(members, max_restarts=3, lighthouse=None, stopping=None):
    for member in members:
        member.start()
    try:
        return replicas._watch(members, max_restarts, stopping or {"signal": 0}, lighthouse)
    finally:
        for member in members:
            member.kill()


# ---------------------------------------------------------------------- how a group ended
def test_torchruns_status_1_is_read_through_the_processes_records():
    agreed = [{"code": 75, "usage": False}, {"code": 75, "usage": False}]
    assert replicas.ending_of(1, agreed, 2) == replicas.Ending(75)  # a requeue, saved on every process
    assert replicas.ending_of(1, agreed[:1], 2) == replicas.Ending(1)  # one process never said: a failure
    assert replicas.ending_of(1, [{"code": 1, "usage": True}], 2) == replicas.Ending(1, usage=True)
    assert replicas.ending_of(1, [{"code": 2, "usage": False}], 2) == replicas.Ending(2, usage=True)
    assert replicas.ending_of(-9, [], 1) == replicas.Ending(137)
    assert replicas.ending_of(0, [{"code": 75, "usage": False}], 1) == replicas.Ending(0)


def test_each_process_records_its_exit_status_and_whether_it_was_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    cases = {"pass": (None, 0, False), "raise SystemExit(75)": (SystemExit, 75, False),
             "raise SystemExit(2)": (SystemExit, 2, False), "raise ValueError('x')": (ValueError, 1, False),
             "from unified_dist.errors import SettingError\nraise SettingError('bad')": (Exception, 1, True),
             "from unified_dist.errors import PeerLost\nraise PeerLost('gone')": (Exception, 1, False)}
    for i, (body, (raised, code, usage)) in enumerate(cases.items()):
        script = tmp_path / f"script{i}.py"
        script.write_text(body + "\n")
        folder = tmp_path / f"status{i}"
        folder.mkdir()
        environ = {replica_child.STATUS_VAR: str(folder), "RANK": "1"}
        if raised is None:
            replica_child.run_script([str(script)], environ)
        else:
            with pytest.raises(raised):
                replica_child.run_script([str(script)], environ)
        assert json.loads((folder / "rank1.json").read_text()) == {"code": code, "usage": usage}, body


# ---------------------------------------------------------------------- item 1b: a late restart after a good end
def test_a_group_failing_after_another_ended_well_ends_the_job_well(tmp_path, capsys):
    finished = group(0, "pass", tmp_path)
    late = group(1, "import time; time.sleep(1.5); raise SystemExit(1)", tmp_path)
    assert watch([finished, late]) == 0
    assert late.exit_codes == [1] and late.restarts == 0  # not started again: nothing left to do
    lines = [line for line in capsys.readouterr().err.splitlines() if "unified-dist launch" in line]
    assert lines == ["unified-dist launch: replica group 1 exited with 1 after replica group 0 ended well: group 0's "
                     "final state stands, and the late restart had nothing left to do"]


# ---------------------------------------------------------------------- item 4: a usage error is not restarted
@pytest.mark.parametrize("body", ["leave(2)", "leave(1, usage=True)", "sys.exit(2)"])
def test_a_usage_error_on_a_first_start_is_not_restarted_and_stops_the_job(tmp_path, capsys, body):
    steady = group(0, "import time; time.sleep(60)", tmp_path)
    wrong = group(1, RECORDS + body, tmp_path)
    started = time.monotonic()
    expected = 1 if "usage=True" in body else 2
    assert watch([steady, wrong]) == expected
    assert time.monotonic() - started < 30 and wrong.exit_codes and wrong.restarts == 0
    assert f"replica group 1 stopped on a usage error (exit status {expected})" in capsys.readouterr().err


def test_a_restarted_groups_failure_before_its_first_step_is_restarted_as_any_failure(tmp_path):
    marker = tmp_path / "second-start"
    steady = group(0, "import time; time.sleep(4)", tmp_path)
    code = RECORDS + (f"p = pathlib.Path({str(marker)!r})\n"
                      "if os.environ['REPLICA_GROUP_RESTARTS'] == '0': sys.exit(3)\n"
                      "if not p.exists(): p.touch(); leave(1, usage=True)\n")
    flaky = group(1, code, tmp_path)
    assert watch([steady, flaky]) == 0
    assert flaky.exit_codes == [3, 1, 0]


# ---------------------------------------------------------------------- item 3: a stop signal reaches the groups
STOPPABLE = RECORDS + ("import signal\n"
                       "signal.signal(signal.SIGTERM, lambda *_: leave(75))\n"
                       "open(folder.parent.parent / f'ready{os.environ[\"REPLICA_GROUP_ID\"]}', 'w').close()\n"
                       "time.sleep(60)\n")


def test_sigterm_is_passed_to_every_group_and_the_job_exits_with_the_status_they_agreed(tmp_path, capsys):
    members = [group(i, STOPPABLE, tmp_path) for i in (0, 1)]
    stopping = {"signal": 0}
    for member in members:
        member.start()
    try:
        while not all((tmp_path / "status" / f"ready{i}").exists() for i in (0, 1)):
            time.sleep(0.1)
        stopping["signal"] = signal.SIGTERM
        assert replicas._watch(members, 3, stopping) == 75
    finally:
        for member in members:
            member.kill()
    assert [m.process.returncode for m in members] == [1, 1]  # each ended on its own, within the grace
    err = capsys.readouterr().err
    assert "SIGTERM: passing it to replica groups 0, 1, which have 30 s to stop at an agreed step and save" in err
    assert "every replica group stopped and ended with 75 (saved for a requeue" in err


def test_a_group_that_does_not_stop_within_the_grace_is_killed_and_the_job_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(replicas, "STOP_GRACE_S", 1.0)
    monkeypatch.setattr(replicas, "TORCHRUN_REPORT_S", 0.5)
    stubborn = RECORDS + ("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                          "open(folder.parent.parent / 'ready', 'w').close()\ntime.sleep(60)\n")
    members = [group(0, stubborn, tmp_path)]
    members[0].start()
    try:
        while not (tmp_path / "status" / "ready").exists():
            time.sleep(0.1)
        assert replicas._watch(members, 3, {"signal": signal.SIGTERM}) == 137
    finally:
        members[0].kill()
    assert "replica groups 0 did not stop within the grace: killed" in capsys.readouterr().err


# ---------------------------------------------------------------------- item 2: the lighthouse
def test_the_lighthouse_binds_a_port_it_chose_and_comes_back_on_it_after_a_sigkill(tmp_path, capsys):
    lighthouse = replicas.Lighthouse(tmp_path / "lighthouse.log")
    lighthouse.start()
    try:
        port, first = lighthouse.port, lighthouse.process.pid
        assert port > 0
        with socket.create_connection(("localhost", port), timeout=5):
            pass
        steady = group(0, "import time; time.sleep(3)", tmp_path)
        steady.start()
        os.kill(first, signal.SIGKILL)
        assert replicas._watch([steady], 3, {"signal": 0}, lighthouse) == 0
        assert lighthouse.alive() and lighthouse.port == port and lighthouse.process.pid != first
        with socket.create_connection(("localhost", port), timeout=5):
            pass
    finally:
        lighthouse.kill()
    log = (tmp_path / "lighthouse.log").read_text()
    assert log.count(f"{replica_child.READY}{port}") == 2
    assert f"the torchft lighthouse (pid {first}) exited with 137; starting it again at http://localhost:{port}" in \
        capsys.readouterr().err


def test_a_lighthouse_that_cannot_come_back_stops_the_job_in_one_line(tmp_path, monkeypatch, capsys):
    lighthouse = replicas.Lighthouse(tmp_path / "lighthouse.log")
    lighthouse.start()
    monkeypatch.setattr(replicas, "LIGHTHOUSE_START_S", 8.0)  # for the restart: a few tries (each a Python start)
    squatter = socket.socket(socket.AF_INET6)
    try:
        os.kill(lighthouse.process.pid, signal.SIGKILL)
        lighthouse.process.wait()
        squatter.bind(("::", lighthouse.port))  # another program takes the port meanwhile
        squatter.listen()
        steady = group(0, "import time; time.sleep(30)", tmp_path)
        steady.start()
        try:
            assert replicas._watch([steady], 3, {"signal": 0}, lighthouse) == 1
        finally:
            steady.kill()
    finally:
        squatter.close()
        lighthouse.kill()
    lines = [line for line in capsys.readouterr().err.splitlines() if "could not be started again" in line]
    assert len(lines) == 1 and "Address already in use" in lines[0] and "stopping the job" in lines[0]


# ---------------------------------------------------------------------- 5c, 5d
def test_replica_groups_imply_the_torch_backend_and_refuse_another(cli_in_process, tmp_path):
    (tmp_path / "train.py").write_text("")
    implied = cli_in_process("launch", "--dry-run", "--replica-groups", "2", "train.py", cwd=tmp_path)
    assert implied.returncode == 0, implied.stderr
    assert "torchrun --standalone --nproc_per_node 1 train.py" in implied.stdout.splitlines()[1]
    other = cli_in_process("launch", "--dry-run", "--backend", "horovod", "--replica-groups", "2", "train.py",
                           cwd=tmp_path)
    assert other.returncode == 2 and len(other.stderr.strip().splitlines()) == 1
    assert "leave out --backend horovod" in other.stderr
    missing = cli_in_process("launch", "--dry-run", "train.py", cwd=tmp_path)
    assert missing.returncode == 2 and "--backend is required" in missing.stderr


def test_groups_that_would_share_gpus_are_refused():
    assert replicas.check_gpus(2, 2, 0, {}) is None  # no GPU: nothing to share
    assert replicas.check_gpus(2, 2, 4, {}) == ["0", "1", "2", "3"]
    assert replicas.check_gpus(2, 1, 8, {"CUDA_VISIBLE_DEVICES": "3,5"}) == ["3", "5"]
    with pytest.raises(UsageError, match="needs 4 GPUs, one per process, and this host shows 3") as caught:
        replicas.check_gpus(2, 2, 3, {})
    assert "\n" not in str(caught.value)
    with pytest.raises(UsageError, match=r"shows 1 \(CUDA_VISIBLE_DEVICES=6\)"):
        replicas.check_gpus(2, 1, 1, {"CUDA_VISIBLE_DEVICES": "6"})
    with pytest.raises(UsageError, match="needs 2 GPUs"):  # listed, but CUDA shows only the first
        replicas.check_gpus(2, 1, 1, {"CUDA_VISIBLE_DEVICES": "0,7"})


def test_groups_ask_the_lighthouse_again_for_a_quorum_its_death_broke():
    command = Command(("torchrun", "train.py"))
    assert replicas.group_env(command, 0, 2, "http://x", {})["TORCHFT_QUORUM_RETRIES"] == "10"
    assert replicas.group_env(command, 0, 2, "http://x", {"TORCHFT_QUORUM_RETRIES": "3"})["TORCHFT_QUORUM_RETRIES"] \
        == "3"  # the user's own choice stands


def test_the_lighthouse_writes_its_port_line_and_newline_in_one_write(monkeypatch, capfd):
    """torchft's server logs from its own threads into the same file: the port line must reach it in one write,
    or a log line can land between the port and its newline (seen under PYTHONUNBUFFERED: port '34395' read as
    '343952026-11-28T15:41:16.315')."""
    writes = []
    real = os.write
    monkeypatch.setattr(replica_child.os, "write", lambda fd, data: writes.append(data) or real(fd, data))
    replica_child._say(f"{replica_child.READY}34395")
    assert writes == [f"{replica_child.READY}34395\n".encode()]
    assert capfd.readouterr().out == f"{replica_child.READY}34395\n"


def test_the_launcher_finds_the_port_line_inside_a_log_line_torchft_wrote_in_pieces():
    """torchft's logger writes a line in several writes, so the port line (one write) can land inside one of its
    lines: seen in CI, the launcher looked only at lines' starts, missed it and said the lighthouse did not start."""
    ready = replica_child.READY
    interleaved = (f"2026-11-30T09:12:05.396 [{ready}37045\nINFO] [torchft::lighthouse] - Lighthouse listening on: "
                   f"http://vm:37045\n2026-11-30T09:12:05.398 [INFO] [torchft::lighthouse] - Quorum status: ...\n")
    assert replica_child.ready_port(interleaved) == 37045
    assert replica_child.ready_port(f"{ready}34395\n") == 34395
    assert replica_child.ready_port(f"{ready}343") is None  # not yet whole: its newline ends it
    assert replica_child.ready_port("2026-11-30T09:12:05.396 [INFO] [torchft::lighthouse] - listening\n") is None


def test_sigusr1_is_passed_as_sigterm_which_torchrun_passes_on(tmp_path, capsys):
    """SLURM's warning before the time limit: torchrun dies of SIGUSR1 (it passes on only TERM, INT, HUP, QUIT),
    so the launcher passes SIGTERM; the stand-ins stop on SIGTERM only, so the job's 75 says SIGTERM arrived."""
    members = [group(i, STOPPABLE, tmp_path) for i in (0, 1)]
    for member in members:
        member.start()
    try:
        while not all((tmp_path / "status" / f"ready{i}").exists() for i in (0, 1)):
            time.sleep(0.1)
        assert replicas._watch(members, 3, {"signal": signal.SIGUSR1}) == 75
    finally:
        for member in members:
            member.kill()
    err = capsys.readouterr().err
    assert "SIGUSR1: passing it as SIGTERM to replica groups 0, 1, which have 30 s to stop" in err
    assert "after SIGUSR1, every replica group stopped and ended with 75" in err


def test_the_launcher_takes_sigusr1_sigterm_and_sigint_as_a_stop_and_restores_the_handlers(tmp_path, monkeypatch):
    seen = {}

    class Lighthouse:  # a stand-in: the real one is tested below
        def __init__(self, log, join_ms):
            self.log, self.address, self.process = log, "http://x", type("P", (), {"pid": 0})()

        def start(self):
            pass

        def kill(self):
            pass

    def watch(members, max_restarts, stopping, lighthouse):
        for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            seen[signum] = signal.getsignal(signum)
        if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, signal.SIG_IGN, None):
            return -1  # not taken as a stop (sending it would end the test process)
        os.kill(os.getpid(), signal.SIGUSR1)  # handled: the test process goes on
        return stopping["signal"]

    monkeypatch.setattr(replicas, "Lighthouse", Lighthouse)
    monkeypatch.setattr(replicas.Group, "start", lambda self: None)
    monkeypatch.setattr(replicas, "_watch", watch)
    before = signal.getsignal(signal.SIGUSR1)
    assert replicas.run(Command((sys.executable, "-c", "pass")), 2, 3, 1, log_dir=str(tmp_path)) == signal.SIGUSR1
    assert len({id(h) for h in seen.values()}) == 1 and seen[signal.SIGUSR1] not in (signal.SIG_DFL, before)
    assert signal.getsignal(signal.SIGUSR1) == before


def test_what_the_launcher_started_ends_when_the_launcher_is_killed(tmp_path):
    """SIGKILL of the launcher (nothing cleans up): the kernel sends each group SIGTERM (PR_SET_PDEATHSIG)."""
    import subprocess

    code = ("import sys, time\n"
            "from unified_dist.cli import replicas\n"
            "from unified_dist.cli.launch import Command\n"
            "g = replicas.Group(0, Command((sys.executable, '-c', 'import time; time.sleep(120)')), {}, nproc=1)\n"
            "g.start(); print(g.process.pid, flush=True); time.sleep(120)\n")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(launcher.stdout.readline())
        os.kill(child, 0)  # it runs
        launcher.kill()
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError):
                break
            if state == "Z":  # ended; whoever adopted it has not reaped it yet
                break
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            raise AssertionError(f"the group (pid {child}) outlived its killed launcher by 20 s")
    finally:
        launcher.kill()
