"""The version matrix (issue #52): the contract and the unit tests in a scratch environment per Python × torch.

Each cell ``PYTHON:TORCH`` (e.g. ``3.12:2.15.0``) gets its own virtual environment outside the repository
(``~/.cache/unified_dist/versions/<python>-torch<torch>/``), built in this order:

1. the Makefile's pip/wheel/setuptools, then the requested torch alone (pip's global constraint file, which
   caps torch on these machines, is replaced for the scratch pip by one that says ``torch==TORCH``);
2. every other pin of requirements-ci.txt; accelerate, transformers and datasets stay at their pins unless
   they refuse that torch when imported (transformers disables torch below its minimum), in which case
   the newest release that accepts it is installed and the row says so;
3. Horovod with the commit's ``tools/build_horovod.sh`` (its wheels are cached by horovod/torch/python
   version); against a CUDA build of torch, Horovod's CMake wants a CUDA toolkit, which the build is pointed
   at (``HOROVOD_CUDA_HOME``, see :meth:`Cell.horovod_env`). If it does not build, the row records
   ``"not built: <first error line>"`` and the cell goes on with ``UNIFIED_DIST_WITHOUT_HOROVOD=1``;
4. the project itself, ``pip install --no-deps -e`` of a ``git archive HEAD`` copy (the row's commit), then
   DeepSpeed's CPU collectives op built into the environment, as ``make setup`` builds it.

Then, in that environment: ``python -m unified_dist test`` (the contract under torchrun, accelerate launch
and horovodrun, 2 processes each: one count per backend and check) and ``pytest tests/unit`` of the same
copy. A row per cell goes to ``tools/versions/versions.json`` (``{"rows": [...]}`` beside the provenance
fields every results file has; a row of the same Python and torch is replaced), with each failed test's
first error line; everything a cell ran, with its output, is in ``~/.cache/unified_dist/versions/<cell>.log``.
``--render`` writes docs/versions.md from the results file (a run writes it after each cell too).

    OMP_NUM_THREADS=1 python tools/versions/versions.py                        # the issue's cells, in order
    OMP_NUM_THREADS=1 python tools/versions/versions.py --cell 3.12:2.15.0     # one cell (repeatable)
    python tools/versions/versions.py --render                                 # docs/versions.md only

Not part of ``make test`` (``make versions``): a cell with a CUDA build of torch downloads 3-4 GB of wheels
(about a minute here; pip's HTTP cache did not keep them on these machines, so a rerun downloads again),
its environment takes about 6 GiB (deleted after the cell unless ``--keep``), and a Horovod build takes
3-6 minutes on 2 cores. A cell takes 7-14 minutes in all.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "shared"))
import provenance  # noqa: E402  (bench/shared/provenance.py: what every results file records)

RESULTS = Path(__file__).resolve().parent / "versions.json"
PAGE = ROOT / "docs" / "versions.md"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "unified_dist" / "versions"
DEFAULT_CELLS = ("3.11:2.13.0", "3.11:2.15.0", "3.11:2.6.0", "3.12:2.15.0")
"""The pin first (it must pass: a quick check of this tool), then the newest release, the oldest we try, and
the newest on a second Python."""
TOOLING = ("pip==26.3", "wheel==0.48.0", "setuptools==84.2.1")
"""What the Makefile installs before anything else."""
LIBRARIES = ("accelerate", "transformers", "datasets")
"""The libraries a row names; each is kept at its pin unless it refuses the cell's torch."""
BACKENDS = ("torch", "accelerate", "horovod", "deepspeed")
"""The backends ``unified-dist test`` runs in a cell: Horovod where it built; DeepSpeed where the pins name it (a
DeepSpeed that does not install stops the cell)."""
CONTRACT_TIMEOUT_S = 1200
UNIT_TIMEOUT_S = 3600
FALLBACK_TRIES = 8
ROW = re.compile(r"^(\S+)\s+(\S+)\s+(pass|FAIL|hung|not run)\s+\S+\s*(.*)$")
"""A row of ``unified-dist test``'s table: backend, check, result, seconds, detail."""

PROBE = r"""
import json, importlib, importlib.metadata as md
import torch
report = {"torch": torch.__version__, "cuda": torch.version.cuda, "refused": {}}
checks = {
    "accelerate": "from accelerate import Accelerator",
    "transformers": "import transformers; from transformers.utils import is_torch_available\n"
                    "assert is_torch_available(), 'transformers disables torch ' + torch.__version__\n"
                    "from transformers import PreTrainedModel",
    "datasets": "import datasets",
}
for name, code in checks.items():
    try:
        report[name] = md.version(name)
    except md.PackageNotFoundError:
        report[name] = None
        report["refused"][name] = "not installed"
        continue
    try:
        exec(code, {})
    except Exception as e:
        report["refused"][name] = (type(e).__name__ + ": " + str(e)).splitlines()[0][:200]
try:
    report["deepspeed"] = md.version("deepspeed")  # recorded, not replaced: its sdist builds against the cell's torch
except md.PackageNotFoundError:
    report["deepspeed"] = None
print(json.dumps(report))
"""


# ---------------------------------------------------------------------- small helpers
def log(message: str) -> None:
    print(f"[versions {datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


def run(argv: List[str], env: Dict[str, str], cwd: Optional[Path] = None, timeout: Optional[float] = None,
        log_path: Optional[Path] = None) -> Tuple[int, str]:
    """Run ``argv`` in its own process group (killed whole on timeout); return (exit status or None, output)."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            else:  # stragglers of a finished command (a launcher's workers), if any
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        out.seek(0)
        text = out.read()
    if log_path is not None:
        with open(log_path, "a") as f:
            f.write(f"\n$ {' '.join(argv)}\n{text}\n[exit status {code}]\n")
    return code, text


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


ERROR_PATTERNS = (
    r"#error", r"CMake Error", r"\berror:", r"\b\w+(Error|Exception)\b:", r"No matching distribution", r"ERROR:")
"""What reads like the cause of a failure, most telling first (a compiler's or CMake's error before pip's
summary of it)."""
NOISE = re.compile(r"subprocess-exited-with-error|Failed (building|to build)|metadata-generation-failed|"
                   r"CalledProcessError|^note:|^╰─>|^\[end of output\]|^error: (failed-wheel-build|command)")


def first_error(text: str) -> str:
    """The first line matching the most telling of :data:`ERROR_PATTERNS` (with CMake's message line after
    "CMake Error at ..."), else the last non-empty line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for pattern in ERROR_PATTERNS:
        for i, line in enumerate(lines):
            if re.search(pattern, line) and not NOISE.search(line):
                if line.startswith("CMake Error") and i + 1 < len(lines):
                    line = f"{line.split(' at ')[0]}: {lines[i + 1]}"
                return line[:240]
    return (lines[-1] if lines else "no output")[:240]


def short_paths(text: str) -> str:
    """``text`` with paths into an environment's site-packages or the source copy cut to what follows them,
    and a cell's environment written ``$VENV``."""
    text = re.sub(r"[^\s'\"(]*/site-packages/", "", text)
    text = re.sub(r"[^\s'\"(]*/unified_dist/versions/src-[0-9a-f]+/", "", text)
    return re.sub(r"[^\s'\"(]*/unified_dist/versions/[\d.]+-torch[\d.]+/", "$VENV/", text)


def cuda_toolkit() -> Optional[Path]:
    """A CUDA toolkit with nvcc, headers and libcudart (``$CUDA_HOME``, else /usr/local/cuda), or ``None``."""
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and (Path(candidate) / "bin" / "nvcc").exists() and \
                (Path(candidate) / "include" / "cuda_runtime.h").exists() and \
                any((Path(candidate) / lib / "libcudart.so").exists() for lib in ("lib64", "lib")):
            return Path(candidate)
    return None


def find_python(version: str) -> Path:
    """pyenv's newest ``X.Y.*`` interpreter (or ``pythonX.Y`` on PATH) for ``version`` = ``X.Y`` or ``X.Y.Z``."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    matches = sorted((p for p in pyenv.glob(f"{version}*") if re.fullmatch(rf"{re.escape(version)}(\.\d+)?", p.name)),
                     key=lambda p: [int(x) for x in p.name.split(".")])
    for candidate in reversed(matches):
        if (candidate / "bin" / "python").exists():
            return candidate / "bin" / "python"
    on_path = shutil.which(f"python{'.'.join(version.split('.')[:2])}")
    if on_path:
        return Path(on_path)
    raise SystemExit(f"no Python {version}: not in {pyenv} nor on PATH")


def pins() -> Dict[str, str]:
    """requirements-ci.txt as {name: version} (comments dropped)."""
    found = {}
    for line in (ROOT / "requirements-ci.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[name.strip().lower()] = version.strip()
    return found


def clean_env(venv: Optional[Path] = None) -> Dict[str, str]:
    """This environment without another virtual environment's traces, launcher variables or unified_dist
    settings; ``venv``'s bin/ first on PATH (horovodrun starts ``python`` by name)."""
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CI", "PIP_REQUIRE_VIRTUALENV")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("UNIFIED_DIST_", "HOROVOD_", "ACCELERATE_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    path = [p for p in env.get("PATH", "").split(os.pathsep)
            if p and not (Path(p).parent / "pyvenv.cfg").exists()]  # another venv's bin/
    if venv is not None:
        path.insert(0, str(venv / "bin"))
    env["PATH"] = os.pathsep.join(path)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1", PYTHONUNBUFFERED="1")
    return env


# ---------------------------------------------------------------------- the source copy
def source_copy() -> Tuple[Path, str]:
    """``git archive HEAD`` unpacked once per commit under the cache: (folder, short commit)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    folder = CACHE / f"src-{commit}"
    if not (folder / "setup.cfg").exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile() as archive:
            subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, stdout=archive, check=True)
            archive.seek(0)
            with tarfile.open(fileobj=archive) as tar:
                tar.extractall(folder)
    return folder, commit


# ---------------------------------------------------------------------- building a cell
class Cell:
    """One Python × torch environment and what happened while it was built and tested."""

    def __init__(self, spec: str, source: Path):
        self.source = source  # the git archive copy: its tools/build_horovod.sh, its package, its tests
        self.python_request, _, self.torch_request = spec.partition(":")
        if not self.python_request or not re.fullmatch(r"\d+\.\d+(\.\d+)?", self.torch_request):
            raise SystemExit(f"--cell takes PYTHON:TORCH (e.g. 3.11:2.15.0), got {spec!r}")
        self.base_python = find_python(self.python_request)
        self.python_version = subprocess.run([str(self.base_python), "-c", "import platform; "
                                              "print(platform.python_version())"],
                                             capture_output=True, text=True, check=True).stdout.strip()
        self.venv = CACHE / f"{self.python_version}-torch{self.torch_request}"
        self.py = self.venv / "bin" / "python"
        self.log_path = CACHE / f"{self.python_version}-torch{self.torch_request}.log"
        self.row: Dict = {"python": self.python_version, "torch": self.torch_request}
        self.notes: List[str] = []

    def pip_env(self) -> Dict[str, str]:
        """The scratch pip's environment: our constraint file (``torch==TORCH``) instead of the global one."""
        constraint = self.venv / "constraints.txt"
        constraint.write_text(f"torch=={self.torch_request}\n")
        return {**clean_env(self.venv), "PIP_CONSTRAINT": str(constraint)}

    def pip(self, *args: str, timeout: float = 3600) -> Tuple[int, str]:
        return run([str(self.py), "-m", "pip", *args], self.pip_env(), timeout=timeout, log_path=self.log_path)

    def build(self) -> bool:
        """Create the environment and install everything; False (with ``row["failed_stage"]``) if it cannot."""
        if self.venv.exists():
            shutil.rmtree(self.venv)
        self.log_path.write_text("")
        subprocess.run([str(self.base_python), "-m", "venv", str(self.venv)], check=True)
        start = time.perf_counter()
        code, out = self.pip("install", "--quiet", *TOOLING)
        if code != 0:
            return self.stop("tooling", out)
        code, out = self.pip("install", f"torch=={self.torch_request}")
        self.row["torch_install_seconds"] = round(time.perf_counter() - start, 1)
        if code != 0:
            return self.stop("torch", out)
        start = time.perf_counter()
        requirements = self.venv / "requirements.txt"
        wanted = pins()
        # deepspeed's sdist imports torch to build: installed after, against this torch (as the Makefile does)
        requirements.write_text("".join(f"{name}=={version}\n" for name, version in wanted.items()
                                        if name not in ("torch", "deepspeed")))
        code, out = self.pip("install", "-r", str(requirements))
        if code != 0:
            return self.stop("requirements-ci.txt", out)
        if "deepspeed" in wanted:
            os.environ.setdefault("DS_BUILD_OPS", "0")  # no compiled ops (clean_env copies os.environ)
            code, out = self.pip("install", "--no-build-isolation", f"deepspeed=={wanted['deepspeed']}")
            if code != 0:
                return self.stop("deepspeed", out)
        if not self.keep_libraries_that_accept_torch(wanted):
            return False
        self.row["deps_install_seconds"] = round(time.perf_counter() - start, 1)
        report = self.probe()
        self.row["torch_build"], self.row["torch_cuda"] = report["torch"], report.get("cuda")
        start = time.perf_counter()
        # the commit's own build script: the checkout's may change while a cell runs
        code, out = run(["bash", str(self.source / "tools" / "build_horovod.sh"), str(self.py)], self.horovod_env(),
                        timeout=3600, log_path=self.log_path)
        self.row["horovod_seconds"] = round(time.perf_counter() - start, 1)
        if code == 0:
            self.row["horovod"] = "built"
            cached = "installed from the cached wheel" if "building horovod" not in out else "built here"
            self.notes.append(f"Horovod 0.28.1 {cached}")
        else:
            self.row["horovod"] = f"not built: {short_paths(first_error(out))}"
        code, out = self.pip("install", "--quiet", "--no-deps", "-e", str(self.source))
        if code != 0:
            return self.stop("unified_dist", out)
        if self.row.get("deepspeed") or "deepspeed" in pins():  # as make setup does: no test builds DeepSpeed's op
            code, out = run([str(self.py), "-c", "from unified_dist.testing.launchers import prebuild_deepspeed_ops; "
                             "prebuild_deepspeed_ops()"], clean_env(self.venv), timeout=900, log_path=self.log_path)
            if code != 0:
                return self.stop("DeepSpeed's CPU collectives op", out)
        return True

    def horovod_env(self) -> Dict[str, str]:
        """The Horovod build's environment. Against a CUDA build of torch, horovod/torch/CMakeLists.txt always
        calls ``add_cuda()`` (it needs nvcc, CUDA headers and libcudart, which the torch wheel does not ship
        as CMake finds them): point it at the machine's toolkit, where there is one, with Horovod's own
        ``HOROVOD_CUDA_HOME`` (CMake otherwise derives the root from the first ``nvcc`` on PATH, which may be
        a wrapper script in /usr/local/bin)."""
        env = clean_env(self.venv)
        cuda = self.row.get("torch_cuda")
        toolkit = cuda_toolkit()
        if cuda and toolkit is not None:
            env.update(HOROVOD_CUDA_HOME=str(toolkit), CUDA_HOME=str(toolkit), CUDAToolkit_ROOT=str(toolkit))
            env["PATH"] = os.pathsep.join([str(self.venv / "bin"), str(toolkit / "bin"), env["PATH"]])
            self.notes.append(f"torch is a CUDA {cuda} build: Horovod's build pointed at the CUDA toolkit at "
                              f"{toolkit} ({toolkit.resolve().name})")
        elif cuda:
            self.notes.append(f"torch is a CUDA {cuda} build and this machine has no CUDA toolkit for Horovod")
        return env

    def stop(self, stage: str, out: str) -> bool:
        self.row["failed_stage"] = f"install {stage}: {first_error(out)}"
        log(self.row["failed_stage"])
        return False

    def probe(self) -> Dict:
        code, out = run([str(self.py), "-c", PROBE], clean_env(self.venv), timeout=600, log_path=self.log_path)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if code != 0 or not lines:
            return {"torch": None, "refused": {"torch": first_error(out)}}
        return json.loads(lines[-1])

    def switches(self) -> Dict[str, str]:
        """The side of each switch of ``unified_dist.compat`` this cell's torch takes (``compat.sides()``)."""
        code, out = run([str(self.py), "-c", "import json; from unified_dist import compat; "
                         "print(json.dumps(compat.sides()))"], clean_env(self.venv), timeout=300,
                        log_path=self.log_path)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if code == 0 and lines else {}

    def keep_libraries_that_accept_torch(self, wanted: Dict[str, str]) -> bool:
        """Replace each of :data:`LIBRARIES` that refuses this torch by the newest older release that accepts it."""
        report = self.probe()
        for name in LIBRARIES:
            if name not in report["refused"]:
                continue
            reason = report["refused"][name]
            log(f"{name} {wanted.get(name)} refuses torch {self.torch_request}: {reason}")
            accepted = None
            for version in self.older_releases(name, wanted.get(name))[:FALLBACK_TRIES]:
                code, _ = self.pip("install", "--quiet", f"{name}=={version}")
                if code == 0 and name not in self.probe()["refused"]:
                    accepted = version
                    break
            if accepted is None:
                return self.stop(name, f"{name} refuses torch {self.torch_request} ({reason}); no older "
                                 f"release of the last {FALLBACK_TRIES} accepts it")
            self.notes.append(f"{name} {accepted} instead of the pin {wanted.get(name)} ({reason})")
        return True

    def older_releases(self, name: str, pin: Optional[str]) -> List[str]:
        """Releases of ``name`` older than ``pin``, newest first (``pip index versions``: one look-up)."""
        code, out = self.pip("index", "versions", name, timeout=300)
        match = re.search(r"Available versions:\s*(.+)", out)
        if code != 0 or not match:
            return []
        from packaging.version import InvalidVersion, Version

        releases = []
        for text in match.group(1).split(","):
            with contextlib.suppress(InvalidVersion):
                version = Version(text.strip())
                if not version.is_prerelease and (pin is None or version < Version(pin)):
                    releases.append(version)
        return [str(v) for v in sorted(releases, reverse=True)]


# ---------------------------------------------------------------------- testing a cell
def contract(cell: Cell, source: Path) -> Dict:
    """``unified-dist test`` under each launcher, 2 processes: a check counts once per backend."""
    backends = [b for b in BACKENDS if (b != "horovod" or cell.row.get("horovod") == "built")
                and (b != "deepspeed" or cell.row.get("deepspeed"))]
    argv = [str(cell.py), "-m", "unified_dist", "test", "--nproc", "2", "--backend", ",".join(backends)]
    env = clean_env(cell.venv)
    if cell.row.get("horovod") != "built":
        env["UNIFIED_DIST_WITHOUT_HOROVOD"] = "1"
    start = time.perf_counter()
    code, out = run(argv, env, cwd=source, timeout=CONTRACT_TIMEOUT_S, log_path=cell.log_path)
    result = {"passed": 0, "failed": 0, "failures": [], "errors": {}, "backends": backends,
              "seconds": round(time.perf_counter() - start, 1)}
    in_table = False
    for line in out.splitlines():
        if line.startswith("backend") and "check" in line and "result" in line:
            in_table = True
            continue
        if in_table and not line.strip():
            break
        if in_table:
            match = ROW.match(line)
            if not match:
                continue
            backend, check, status, detail = match.groups()
            if status == "pass":
                result["passed"] += 1
            else:
                name = f"contract[{backend}]::{check}"
                result["failed"] += 1
                result["failures"].append(name)
                result["errors"][name] = f"{status}: {detail.strip()}"[:240]
    if code != 0 and not result["failed"]:  # no table: the command itself failed
        name = "contract::unified-dist test"
        result["failed"] += 1
        result["failures"].append(name)
        result["errors"][name] = "timed out" if code is None else first_error(out)
    return result


def unit_tests(cell: Cell, source: Path) -> Dict:
    """``pytest tests/unit`` of the source copy in the cell's environment, counted from its JUnit file."""
    env = clean_env(cell.venv)
    if cell.row.get("horovod") != "built":
        env["UNIFIED_DIST_WITHOUT_HOROVOD"] = "1"
    with tempfile.TemporaryDirectory(prefix="versions-junit-") as tmp:
        junit = Path(tmp) / "unit.xml"
        argv = [str(cell.py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit", f"--junitxml={junit}"]
        start = time.perf_counter()
        code, out = run(argv, env, cwd=source, timeout=UNIT_TIMEOUT_S, log_path=cell.log_path)
        result = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "errors": {}, "skip_reasons": {},
                  "seconds": round(time.perf_counter() - start, 1)}
        if not junit.exists():
            result["failed"] = 1
            result["failures"] = ["tests/unit (no JUnit file)"]
            result["errors"]["tests/unit (no JUnit file)"] = "timed out" if code is None else first_error(out)
            return result
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                result["failed"] += 1
                result["failures"].append(name)
                result["errors"][name] = failure_line(bad.get("message") or "", bad.text or "")
            elif case.find("skipped") is not None:
                result["skipped"] += 1
                reason = (case.find("skipped").get("message") or "").strip()[:160]
                result["skip_reasons"][reason] = result["skip_reasons"].get(reason, 0) + 1
            else:
                result["passed"] += 1
    return result


CAUSE = re.compile(r"\b((?!Assertion)\w+(?:Error|Exception): .*)")
"""An exception's line in a traceback, other than the test's own assertion."""


def failure_line(message: str, text: str) -> str:
    """A failed test in one line: where it failed (``file.py:N: ErrorType``), the message's first line, and
    the failing ``assert`` expression where the message alone says little."""
    lines = text.splitlines()
    where = next((line for line in reversed(lines) if re.match(r"^\S+\.py:\d+: \w+", line)), "")
    first = (message.strip().splitlines() or ["?"])[0]
    assertion = next((line[1:].strip() for line in lines if re.match(r"^E\s+assert ", line)), "")
    # an exception raised in a launched process (its traceback quoted in the assertion's message)
    raised = (CAUSE.search(line) for line in lines)
    cause = next((m.group(1) for m in raised if m and "ChildFailedError" not in m.group(1)), "")
    parts = [where, cause if cause and cause not in first else "", first,
             assertion if assertion and len(first) < 60 else ""]
    return short_paths(" | ".join(part for part in parts if part))[:240]


def run_cell(spec: str, keep: bool) -> Dict:
    source, commit = source_copy()
    cell = Cell(spec, source)
    wall = time.perf_counter()
    log(f"cell {cell.python_version} × torch {cell.torch_request}: building {cell.venv} (log {cell.log_path})")
    built = False
    try:
        built = cell.build()
        cell.row["venv_bytes"] = tree_bytes(cell.venv)
        if built:
            report = cell.probe()
            cell.row.update({name: report.get(name) for name in (*LIBRARIES, "deepspeed")})
            cell.row["switches"] = cell.switches()
            log(f"built: torch {cell.row.get('torch_build')}, horovod {cell.row['horovod']}; running the contract")
            parts = {"contract": contract(cell, source)}
            log(f"contract: {parts['contract']['passed']} passed, {parts['contract']['failed']} failed; unit tests")
            parts["unit"] = unit_tests(cell, source)
            log(f"unit: {parts['unit']['passed']} passed, {parts['unit']['failed']} failed, "
                f"{parts['unit']['skipped']} skipped")
            failures = [n for part in parts.values() for n in part["failures"]]
            errors = {n: e for part in parts.values() for n, e in part["errors"].items()}
            cell.row.update(passed=sum(p["passed"] for p in parts.values()),
                            failed=sum(p["failed"] for p in parts.values()),
                            failures=failures[:20], first_errors={n: errors[n] for n in failures[:20]},
                            contract={k: v for k, v in parts["contract"].items() if k not in ("failures", "errors")},
                            unit={k: v for k, v in parts["unit"].items() if k not in ("failures", "errors")})
        else:
            cell.row.update(passed=0, failed=1, failures=[cell.row["failed_stage"]],
                            first_errors={cell.row["failed_stage"]: cell.row["failed_stage"]})
    finally:
        if not keep and cell.venv.exists():
            shutil.rmtree(cell.venv)
    cell.row.setdefault("horovod", "not built: the cell stopped before Horovod")
    cell.row.update(commit=commit, command=" ".join(["python", "tools/versions/versions.py", "--cell", spec]),
                    seconds=round(time.perf_counter() - wall, 1), notes=cell.notes,
                    date=datetime.date.today().isoformat(), cpu=provenance.cpu_model())
    order = ["python", "torch", *LIBRARIES, "horovod", "deepspeed", "passed", "failed", "failures", "first_errors",
             "command", "commit", "seconds", "venv_bytes"]
    return {**{k: cell.row[k] for k in order if k in cell.row}, **{k: v for k, v in cell.row.items() if k not in order}}


# ---------------------------------------------------------------------- results and the page
def load_results() -> Dict:
    if RESULTS.exists():
        return json.loads(RESULTS.read_text())
    return {"rows": []}


def save_row(row: Dict, record: Dict) -> None:
    """Put ``row`` in the results file (replacing the row of the same Python and torch), with provenance."""
    results = load_results()
    rows = [r for r in results.get("rows", []) if (r["python"], r["torch"]) != (row["python"], row["torch"])]
    rows.append(row)
    rows.sort(key=lambda r: ([int(x) for x in r["python"].split(".")], [int(x) for x in r["torch"].split(".")]))
    results = {**provenance.finish(dict(record)), "commit": row["commit"], "rows": rows}
    results.pop("cpu_ticks_before", None)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def declared(rows: List[dict]) -> Dict[str, str]:
    """What setup.cfg may declare, from the rows: the oldest torch and the oldest Python (major.minor) among the
    cells with ``failed == 0``, and the newest torch tested. Raises ``ValueError`` where a cell inside those
    bounds failed (a declared range must hold only passing cells)."""
    from packaging.version import Version

    passing = [r for r in rows if r.get("failed") == 0 and r.get("passed", 0) > 0]
    if not passing:
        raise ValueError("no cell passed: nothing can be declared")
    torch = min((r["torch"] for r in passing), key=Version)
    python = min((".".join(r["python"].split(".")[:2]) for r in passing), key=Version)
    inside = [r for r in rows if r not in passing and Version(r["torch"]) >= Version(torch)
              and Version(".".join(r["python"].split(".")[:2])) >= Version(python)]
    if inside:
        raise ValueError("cells inside the declared bounds failed: "
                         + ", ".join(f"{r['python']} x torch {r['torch']}" for r in inside))
    newest = max((r["torch"] for r in rows), key=Version)
    pythons = sorted({".".join(r["python"].split(".")[:2]) for r in passing}, key=Version)
    return {"torch": torch, "python": python, "newest_torch": newest, "pythons": ", ".join(pythons)}


def supported_line(rows: List[dict]) -> str:
    """The README's line, rendered from the rows."""
    bounds = declared(rows)
    return (f"Supported versions: Python {bounds['python']} and newer (tested: {bounds['pythons']}), torch "
            f"{bounds['torch']} to {bounds['newest_torch']} (setup.cfg: `python_requires >= {bounds['python']}`, "
            f"`torch>={bounds['torch']}`); every tested cell is in [docs/versions.md](docs/versions.md).")


def declared_text(rows: List[dict]) -> str:
    bounds = declared(rows)
    return (f"`python_requires >= {bounds['python']}` and `torch>={bounds['torch']}`, no upper bound (the newest "
            f"release, torch {bounds['newest_torch']}, passed). Older cells that failed stay below for the record.")


def switches_section(rows: List[dict]) -> List[str]:
    """The switches of ``unified_dist/compat.py`` (one per difference between torch releases) and the
    cells that took each side, from the rows that recorded ``compat.sides()``."""
    taken: Dict[str, Dict[str, List[str]]] = {}
    for r in rows:
        for name, side in (r.get("switches") or {}).items():
            taken.setdefault(name, {}).setdefault(side, []).append(f"{r['python']} × {r['torch']}")
    lines = ["", "## Switches between torch releases", "",
             "Each difference between the releases above is one switch in `unified_dist/compat.py`, which probes",
             "the installed torch (not its version number); `tests/unit/test_compat.py` runs each switch on the",
             "side its cell takes. Sides taken, by the cells that recorded them:", ""]
    if not taken:
        return lines + ["(no cell has recorded its sides yet)"]
    for name in sorted(taken):
        sides = "; ".join(f"`{side}`: {', '.join(cells)}" for side, cells in sorted(taken[name].items()))
        lines.append(f"- `{name}`: {sides}")
    return lines


def render() -> str:
    """docs/versions.md: one table row per cell of tools/versions/versions.json."""
    rows = load_results().get("rows", [])
    lines = ["# Supported versions", "",
             "Every cell below is a scratch virtual environment with that Python and torch, the project's other",
             "pins (requirements-ci.txt) and Horovod 0.28.1 built against that torch with `tools/build_horovod.sh`.",
             "In it ran the contract under torchrun, accelerate launch, horovodrun and, in the rows that name a",
             "DeepSpeed, DeepSpeed's launcher with 2 processes each",
             "(`unified-dist test`: one count per launcher and check) and the unit tests (`pytest tests/unit`).",
             "Generated by `python tools/versions/versions.py --render` from `tools/versions/versions.json`;",
             "rerun a cell with `make versions` or `python tools/versions/versions.py --cell 3.12:2.15.0`.", "",
             "Declared (setup.cfg), from the cells with no failure: " + declared_text(rows), "",
             "| Python | torch | accelerate | transformers | datasets | Horovod | DeepSpeed | passed | failed "
             "| commit |",
             "|---|---|---|---|---|---|---|---:|---:|---|"]
    for r in rows:
        horovod = short_paths(r.get("horovod", "?"))
        horovod = horovod if len(horovod) <= 60 else horovod[:57] + "..."
        lines.append(f"| {r['python']} | {r.get('torch_build') or r['torch']} | {r.get('accelerate') or '-'} | "
                     f"{r.get('transformers') or '-'} | {r.get('datasets') or '-'} | {horovod.replace('|', '/')} | "
                     f"{r.get('deepspeed') or '-'} | {r.get('passed', 0)} | {r.get('failed', 0)} | "
                     f"`{r.get('commit', '?')}` |")
    lines += switches_section(rows)
    lines += ["", "## Per cell", ""]
    for r in rows:
        size = f"{r['venv_bytes'] / 2 ** 30:.1f} GiB" if r.get("venv_bytes") else "?"
        timing = f"{r.get('seconds', 0) / 60:.0f} min in all"
        if r.get("torch_install_seconds") is not None:
            timing += f" (torch installed in {r['torch_install_seconds']:.0f} s"
            timing += f", Horovod {r['horovod_seconds']:.0f} s)" if r.get("horovod_seconds") is not None else ")"
        lines.append(f"- **Python {r['python']}, torch {r['torch']}**: `{r.get('command', '?')}` at commit "
                     f"`{r.get('commit', '?')}`, {r.get('date', '?')}; environment {size}; {timing}.")
        unit, contract_ = r.get("unit", {}), r.get("contract", {})
        if unit or contract_:
            lines.append(f"  Contract {contract_.get('passed', 0)} passed, {contract_.get('failed', 0)} failed "
                         f"({', '.join(contract_.get('backends', []))}); unit tests {unit.get('passed', 0)} passed, "
                         f"{unit.get('failed', 0)} failed, {unit.get('skipped', 0)} skipped.")
        for note in r.get("notes", []):
            lines.append(f"  {note}.")
        for name in r.get("failures", []):
            error = r.get("first_errors", {}).get(name, "")
            error = short_paths(error).replace("|", "/").replace("`", "'")
            lines.append(f"  - `{name}`: `{error}`" if error != name else f"  - {short_paths(name)}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", action="append", metavar="PYTHON:TORCH",
                        help=f"a cell to run (repeatable; default: {' '.join(DEFAULT_CELLS)})")
    parser.add_argument("--keep", action="store_true", help="keep each cell's environment (default: deleted after)")
    parser.add_argument("--render", action="store_true", help="only write docs/versions.md from the results file")
    args = parser.parse_args()
    if args.render:
        PAGE.write_text(render())
        print(f"wrote {PAGE.relative_to(ROOT)}")
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    for spec in args.cell or DEFAULT_CELLS:
        record = provenance.start()
        row = run_cell(spec, args.keep)
        save_row(row, record)
        log(f"{spec}: {row['passed']} passed, {row['failed']} failed, horovod {row['horovod']}, "
            f"{row['seconds']:.0f} s, {row.get('venv_bytes', 0) / 2 ** 30:.1f} GiB -> {RESULTS.relative_to(ROOT)}")
        PAGE.write_text(render())


if __name__ == "__main__":
    main()
