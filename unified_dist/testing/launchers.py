"""Run a script under a real launcher (python, torchrun, accelerate launch, horovodrun, srun,
mpirun, the legacy torch.distributed.launch) for the tests and the benchmarks.

Every launch gets its own free port where the launcher takes one, OMP_NUM_THREADS=1, the
venv's ``bin/`` first on PATH (horovodrun starts ``python`` by name), and a timeout after
which every process of its session is killed, so a hang fails the test instead of blocking CI.
srun needs a running cluster: pass ``env={"SLURM_CONF": ...}`` from the ``slurm_cluster`` fixture.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from unified_dist.backends.ports import free_port  # noqa: F401  (tests import it from here)
from unified_dist.detection import LAUNCHER_VARIABLE_PREFIXES, TORCH_VARIABLES
from unified_dist.registry import SPECS

ROOT = Path(__file__).resolve().parents[2]
"""The checkout this package lies in (its tests/, tools/, examples/ and bench/ are what the tests run)."""
BIN = Path(sys.executable).parent
TORCH_EXTENSIONS_DIR = str(Path(sys.prefix) / "torch_extensions")
"""Where DeepSpeed's JIT-built ops (its CPU shared-memory collectives, built at its first ``init_distributed``) lie
for this environment's tests: ``make setup`` builds them there (:func:`prebuild_deepspeed_ops`). Torch's default,
``~/.cache/torch_extensions``, is shared by every checkout of the machine: a launch killed mid-build left its lock
there, and every later DeepSpeed launch waited on it until its timeout; a build made with another ``ninja`` first
on ``PATH`` was rebuilt (2-4 min on 2 cores) inside a test's launch."""


def prebuild_deepspeed_ops() -> None:
    """Build DeepSpeed's shared-memory collectives op into :data:`TORCH_EXTENSIONS_DIR` as the tests' launches load
    it (this environment's ``bin`` first on ``PATH``), so no test pays for the build (``make setup`` runs this)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", TORCH_EXTENSIONS_DIR)
    os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    from deepspeed.comm.torch import build_shm_op

    if build_shm_op() is None:
        print("DeepSpeed has no shared-memory op to build here (nothing done)")


def bench_module(path: str):
    """The script ``<path>.py`` of this checkout (e.g. ``bench/hotpath/hotpath``, ``bench/shared/provenance``,
    ``tools/versions/versions``) imported as module ``bench_<its name>`` (registered in ``sys.modules``, so
    its dataclasses and pickling work), for tests of the benchmark scripts and tools."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{Path(path).name}", ROOT / f"{path}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

LAUNCHERS = ("python", *(spec.launcher for spec in SPECS.values() if spec.launcher and spec.contract))
"""python, then the own launcher of every backend that runs the whole contract, in the registry's order
(``command`` knows each, and ``deepspeed``, whose backend has its own launch tests)."""
BACKEND_OF = {**{spec.launcher or "python": name for name, spec in SPECS.items()},
              "srun": "torch", "mpirun": "torch", "legacy": "torch", "accelerate-fsdp": "accelerate",
              "accelerate-deepspeed": "deepspeed"}
"""The backend each launcher's workers run: the registry's launchers, plus those that start torch."""
# what ud.launcher() reports, where it differs from the key
LAUNCHER_NAME = {"legacy": "torchrun", "accelerate-fsdp": "accelerate", "accelerate-deepspeed": "accelerate"}


ACCELERATE_FLAGS = {
    "accelerate": ("--multi_gpu",),
    # Accelerate's FSDP flags (it refuses --multi_gpu beside --use_fsdp)
    "accelerate-fsdp": ("--use_fsdp", "--fsdp_version", "2", "--fsdp_reshard_after_forward", "false"),
    # Accelerate's DeepSpeed flag (on a CPU without --cpu: Accelerate refuses --cpu beside it), ZeRO stage left to
    # Accelerate's default or the script unless the caller's ``launcher_flags`` say --zero_stage
    "accelerate-deepspeed": ("--use_deepspeed",),
}
"""The ``accelerate launch`` flags that name each Accelerate launcher of :func:`command`."""


def command(launcher: str, script: str, args: Sequence[str] = (), nproc: int = 2,
            launcher_flags: Sequence[str] = ()) -> List[str]:
    """The exact command line a user would type for ``launcher`` on this CPU machine; ``launcher_flags``: more of
    ``accelerate launch``'s own flags after those that name the launcher (e.g. ``--zero_stage 2``)."""
    py = str(BIN / "python")
    if launcher in ACCELERATE_FLAGS:
        return [str(BIN / "accelerate"), "launch", *ACCELERATE_FLAGS[launcher], *launcher_flags,
                "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no", "--main_process_port", str(free_port()), script, *args]
    if launcher_flags:
        raise ValueError(f"launcher_flags are accelerate launch's: not for {launcher}")
    if launcher == "python":
        return [py, script, *args]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", script, *args]
    if launcher == "deepspeed":  # DeepSpeed's launcher: --num_gpus is its processes per node, on a CPU too
        return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), script, *args]
    if launcher == "horovodrun":
        return [str(BIN / "horovodrun"), "-np", str(nproc), "-H", f"localhost:{nproc}", "--gloo",
                "python", script, *args]
    if launcher == "srun":  # fail fast if the cluster cannot place the tasks; a time limit (minutes) as a backstop
        return ["srun", "-n", str(nproc), "--immediate=60", "--time", "10", "--kill-on-bad-exit=1", py, script, *args]
    if launcher == "mpirun":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(nproc), py, script, *args]
    if launcher == "legacy":
        return [py, "-m", "torch.distributed.launch", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port()), script, *args]
    raise ValueError(f"unknown launcher {launcher}")


COMPILE_THREADS = "1"
"""``TORCHINDUCTOR_COMPILE_THREADS`` of every launched process (and of the test processes, tests/conftest.py), unless
the caller set one. Inductor's default on a 2-core machine is 2: each process that compiles starts a pool of compile
workers, which import torch and inductor again (seconds of CPU each) beside the ranks that already fill both cores.
One thread compiles in the process itself; the code it generates is the same. Measured on the hot-path file
(tests/launchers/test_hotpath_under_launchers.py, 4 launches, cold cache, 2-core Xeon): its torchrun launch
56.4 -> 41.6 s wall and 79.9 -> 57.6 CPU-s, the file 106.5 -> 87.0 s."""


ZYGOTE_SITE = ROOT / "unified_dist" / "testing" / "zygote_site"
"""The folder whose ``sitecustomize`` hands a ``python`` to the zygote (unified_dist/testing/zygote.py)."""
ZYGOTE = {"enabled": False, "path": None, "failed": False}
"""This test process's fork server: ``enabled`` while the running test may use it (tests/conftest.py clears it for
tests marked ``fresh_python``), started at the first :func:`child_env` that wants it."""


def _base_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(LAUNCHER_VARIABLE_PREFIXES) and k not in TORCH_VARIABLES and k != "UDTEST_ZYGOTE"}
    env.setdefault("TORCH_EXTENSIONS_DIR", TORCH_EXTENSIONS_DIR)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", COMPILE_THREADS)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    return env


def zygote_env() -> Dict[str, str]:
    """The launches' environment with the zygote's site folder first on ``PYTHONPATH``, without ``UDTEST_ZYGOTE``:
    what a server starts with, and what its clients' variables read at torch's import must equal."""
    env = _base_env()
    env["PYTHONPATH"] = f"{ZYGOTE_SITE}{os.pathsep}{env['PYTHONPATH']}"
    return env


def start_zygote(env: Dict[str, str], folder: str) -> subprocess.Popen:
    """Start a fork server (unified_dist/testing/zygote.py) with ``env``, its socket ``folder/s``, its output in
    ``folder/server.log``; return its process once it serves. RuntimeError (with the log's tail) if it ends first or
    does not serve within 120 s; it is killed then."""
    path = os.path.join(folder, "s")
    with open(os.path.join(folder, "server.log"), "w") as log:
        process = subprocess.Popen([sys.executable, str(ROOT / "unified_dist" / "testing" / "zygote.py"), path],
                                   env=env, cwd=folder, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(path + ".json"):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            with open(os.path.join(folder, "server.log")) as log:
                raise RuntimeError(f"the zygote did not start: {log.read()[-500:]}")
        time.sleep(0.05)
    return process


def _zygote(env: Dict[str, str]) -> Optional[str]:
    """The socket of this process's fork server, started with ``env`` (:func:`zygote_env`) at the first call;
    ``None`` where it could not start (launches then start fresh)."""
    if ZYGOTE["path"] or ZYGOTE["failed"]:
        return ZYGOTE["path"]
    import atexit
    import tempfile

    folder = tempfile.mkdtemp(prefix="udz")
    try:
        process = start_zygote(env, folder)
    except RuntimeError as exc:
        ZYGOTE["failed"] = True
        print(f"{exc}; launches start fresh interpreters", file=sys.stderr)
        return None
    ZYGOTE["path"] = os.path.join(folder, "s")
    atexit.register(process.kill)
    return ZYGOTE["path"]


def zygote_cpu() -> float:
    """CPU seconds of the forks that ended so far (the server's ``SOCKET.cpu``)."""
    if not ZYGOTE["path"]:
        return 0.0
    try:
        with open(ZYGOTE["path"] + ".cpu") as handle:
            return float(handle.read() or 0.0)
    except (OSError, ValueError):
        return 0.0


def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of a launch: this process's, without a launcher's variables, with one OpenMP thread, offline
    Hugging Face, unbuffered Python, the venv's ``bin/`` on ``PATH``, this checkout on ``PYTHONPATH``, then
    ``extra``. While :data:`ZYGOTE` is enabled, the zygote's site folder leads ``PYTHONPATH`` and
    ``UDTEST_ZYGOTE`` names the server: a ``python`` started with it is a fork of one that imported torch
    (unified_dist/testing/zygote.py says when it is not)."""
    env = zygote_env() if ZYGOTE["enabled"] else _base_env()
    if ZYGOTE["enabled"]:
        path = _zygote(dict(env))
        if path:
            env["UDTEST_ZYGOTE"] = path
    env.update(extra or {})
    return env


IN_CI = os.environ.get("CI", "").lower() == "true"


def unavailable(reason: str) -> None:
    """Skip for a missing system tool, except under CI=true, where `make setup` installs it: fail."""
    import pytest

    if IN_CI:
        pytest.fail(f"{reason} (CI=true: `make setup` installs it as root; a skip would hide the gap)")
    pytest.skip(reason)


@dataclass
class Result:
    cmd: List[str]
    returncode: int
    output: str
    timed_out: bool

    def check(self) -> "Result":
        assert not self.timed_out, f"timed out: {' '.join(self.cmd)}\n{self.output[-4000:]}"
        assert self.returncode == 0, f"exit {self.returncode}: {' '.join(self.cmd)}\n{self.output[-4000:]}"
        return self


def _communicate(cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]], cwd: Optional[Path],
                 stderr: int) -> Tuple[subprocess.Popen, str, str, bool]:
    """Run ``cmd`` in its own session: the process, its stdout and stderr (``""`` when merged into
    stdout), and whether it timed out (its whole session is then killed)."""
    started, cpu_before = time.monotonic(), _children_cpu()
    proc = subprocess.Popen(list(cmd), cwd=cwd or ROOT, env=env or child_env(), stdout=subprocess.PIPE,
                            stderr=stderr, text=True, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc, out, err or "", False
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_session(proc.pid)
        out, err = proc.communicate()
        return proc, out, err or "", True
    finally:
        if proc.poll() is None:
            kill_session(proc.pid)
        _log_launch(cmd, time.monotonic() - started, _children_cpu() - cpu_before, timed_out)


LAUNCH_LOG = "UNIFIED_DIST_LAUNCH_LOG"
"""Where :func:`run` and :func:`run_apart` append one JSON line per command they ran (``make test``:
build/launches.jsonl): the test that ran it (pytest's ``PYTEST_CURRENT_TEST``), the launcher (the command's
first word, ``accelerate`` for ``accelerate launch``), the script, its wall seconds and the CPU seconds of the
processes it started. bench/suite_time/suite_time.py sums them: what the suite's launches cost, apart from its
tests' own work."""


def _children_cpu() -> float:
    """User and system CPU seconds of this process's children that ended and were waited for (a launcher
    waits for its workers, so a launch's workers are counted in it), and of the zygote's forks that ended. Two
    launches that run at once in one test process (a fixture that overlaps its launches) share their sum: each is
    counted once, in whichever ends last."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime + zygote_cpu()


def _log_launch(cmd: Sequence[str], wall_s: float, cpu_s: float, timed_out: bool) -> None:
    path = os.environ.get(LAUNCH_LOG)
    if not path:
        return
    import json

    words = [os.path.basename(str(word)) for word in cmd]
    launcher = "python" if words[0].startswith("python") and "-m" not in words[:2] else words[0]
    if len(words) > 2 and words[1] == "-m":
        launcher = words[2]
    script = next((str(word) for word in cmd if str(word).endswith(".py")), " ".join(words[:3]))
    line = json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0], "launcher": launcher,
                       "script": script, "wall_s": round(wall_s, 2), "cpu_s": round(max(cpu_s, 0.0), 2),
                       "timed_out": timed_out})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as log:  # one short line per write: appends from several workers do not interleave
        log.write(line + "\n")


def run(cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None,
        cwd: Optional[Path] = None) -> Result:
    """Run ``cmd`` in its own session, stderr merged into stdout; on timeout kill the whole process group."""
    proc, out, _, timed_out = _communicate(cmd, timeout, env, cwd, subprocess.STDOUT)
    return Result(list(cmd), -9 if timed_out else proc.returncode, out, timed_out)


def run_apart(cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None,
              cwd: Optional[Path] = None, what: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session with stdout and stderr apart; on timeout kill the whole process
    group and fail the test, naming ``what`` (default: the command) and both outputs' tails."""
    proc, out, err, timed_out = _communicate(cmd, timeout, env, cwd, subprocess.PIPE)
    if timed_out:
        import pytest  # only tests call this

        pytest.fail(f"{what or ' '.join(cmd)} did not finish in {timeout:g} s\n{out[-2000:]}\n{err[-2000:]}",
                    pytrace=False)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (a launcher may move its workers to their own groups)
    and every descendant of its leader (torchrun starts each worker in a session of its own)."""
    import psutil

    try:
        for child in psutil.Process(sid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    except psutil.Error:
        pass
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                p.kill()
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass


def launch(launcher: str, script: str, args: Sequence[str] = (), nproc: int = 2, timeout: float = 180,
           env: Optional[Dict[str, str]] = None) -> Result:
    """Run ``script`` under ``launcher`` with ``nproc`` processes (1 for plain python)."""
    return run(command(launcher, script, args, nproc), timeout, child_env(env))


# ---------------------------------------------------------------------- what counts as a launch
LAUNCHER_PROGRAMS = ("torchrun", "horovodrun", "deepspeed", "srun", "mpirun", "mpiexec")
LAUNCHER_MODULES = ("torch.distributed.launch", "torch.distributed.run", "deepspeed.launcher.launch")
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "unified_dist/testing/zygote.py")
"""Processes Python starts beside a single one (its multiprocessing bookkeeping), and the zygote's server and forks
(each fork's client, which is counted, carries the command line it runs): not a launch."""


def is_launcher(cmdline: Sequence[str]) -> bool:
    """Whether a process with this command line is a launcher: torchrun, accelerate launch, horovodrun,
    srun, mpirun/mpiexec, or ``python -m torch.distributed.launch|run`` (entry-point scripts run as
    ``python /venv/bin/torchrun ...``, so the first two words are looked at)."""
    head = [os.path.basename(word) for word in cmdline[:2]]
    if any(word in LAUNCHER_PROGRAMS for word in head):
        return True
    if "accelerate" in head and "launch" in cmdline[:3]:
        return True
    return any(module in cmdline[:4] for module in LAUNCHER_MODULES)


class LaunchWatch:
    """While open, a thread looks at this process's descendants every ``interval`` seconds;
    :attr:`launched` then says how the code inside launched processes, or is ``None``.

    A launch is what the tests' ``distributed`` marker declares: a launcher (:func:`is_launcher`),
    or two or more processes alive at once that were not there when the watch opened, however
    they were started (subprocess, multiprocessing, ``ud.launch``, or a child that launches in turn).
    One process at a time (``python -c ...``, ``unified-dist env``) is not a launch, nor are the
    short helpers it runs beside itself: a process seen for less than ``min_age`` seconds is not counted
    (``mkdocs build`` runs ``git`` and ``ruff format`` for a few milliseconds each; real launches
    import torch and last seconds). A launcher counts at any age. A launch shorter than ``min_age``
    goes unseen.
    """

    def __init__(self, interval: float = 0.1, min_age: float = 1.0):
        self.interval = interval
        self.min_age = min_age
        self._first_seen: Dict[tuple, float] = {}  # (pid, create time) -> when a look first saw it
        self.launched: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._before: set = set()

    def __enter__(self) -> "LaunchWatch":
        import psutil

        self._me = psutil.Process()
        self._before = {p.pid for p in self._me.children(recursive=True)}
        self._thread = threading.Thread(target=self._watch, name="launch-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while self.launched is None:
            self._look()
            if self._stop.wait(self.interval):
                break

    def _look(self) -> None:
        import psutil

        running, launchers = [], []
        now = time.monotonic()
        for child in self._me.children(recursive=True):
            if child.pid in self._before:
                continue
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
                cmdline = child.cmdline()
                age = now - self._first_seen.setdefault((child.pid, child.create_time()), now)
            except psutil.Error:
                continue
            if not cmdline or any(helper in " ".join(cmdline) for helper in HELPERS):
                continue  # an empty command line: it exited between the two reads
            if is_launcher(cmdline):
                launchers.append(cmdline)
            if age >= self.min_age:
                running.append(cmdline)
        if launchers:
            self.launched = f"a launcher ({' '.join(launchers[0])[:200]})"
        elif len(running) >= 2:
            self.launched = f"{len(running)} processes at once ({'; '.join(' '.join(c)[:80] for c in running[:3])})"
