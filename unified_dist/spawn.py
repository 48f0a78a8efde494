"""``ud.launch``: start local worker processes from Python, the way ``mp.spawn``,
Accelerate's ``notebook_launcher`` and ``horovod.run`` do, on any of the three stacks.

The function and its arguments travel to the workers with cloudpickle, so a function typed
into a notebook or a ``python -c`` session works as well as one imported from a module, and
every worker is a fresh ``spawn``-ed interpreter (no ``fork`` of a parent that may already hold
threads, OpenMP pools or a CUDA context). Each worker gets the identity a launcher would give
it (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and a loopback rendezvous on torch and Accelerate,
``horovod.run``'s own on Horovod) plus ``UNIFIED_DIST_BACKEND``, so ``ud.init()`` inside the
function joins the right stack; launcher variables inherited from the caller's own job are
removed first. Rank 0's return value comes back through a file; a worker's exception is
written as text before the worker exits non-zero, which makes each stack's launcher stop the
others, and the caller re-raises it as :class:`WorkerFailed` with that rank's traceback.
"""
from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .backends.ports import free_port
from .detection import ENV_BACKEND, ENV_LAUNCHER, LAUNCHER_VARIABLE_PREFIXES, TORCH_VARIABLES
from .errors import CollectiveTimeout, PeerLost, UnifiedDistError, WorkerFailed
from .registry import SPECS
from .settings import PREFIX

LAUNCH_BACKENDS = tuple(name for name, spec in SPECS.items() if spec.start)
"""Backends ``launch`` can start (each spec's ``start`` names its starter)."""
_SECONDARY = (PeerLost, CollectiveTimeout, KeyboardInterrupt, SystemExit)
"""Errors a worker raises *because* another one failed: never reported as the root cause."""


def launch(fn: Callable[..., Any], *args: Any, nproc: int = 2, backend: str = "torch") -> Any:
    """Run ``fn(*args)`` in ``nproc`` new local processes on ``backend``; return rank 0's result.

    ``backend`` is ``"torch"`` (torch.multiprocessing, gloo on CPU), ``"accelerate"`` or
    ``"horovod"`` (``horovod.run`` with Gloo). Inside ``fn``, ``ud.init()`` (or any ``ud``
    function) joins that stack with ``ud.launcher() == "ud.launch"``; the facade is shut down
    when ``fn`` returns. ``fn``, ``args`` and the result must be picklable by cloudpickle.
    An exception in any worker raises :class:`WorkerFailed` here, naming the rank whose error
    came first and carrying its traceback text; the other workers are stopped.
    """
    if backend not in LAUNCH_BACKENDS:
        raise UnifiedDistError(f"launch(backend={backend!r}): choose one of {', '.join(LAUNCH_BACKENDS)}")
    if not isinstance(nproc, int) or nproc < 1:
        raise UnifiedDistError(f"launch(nproc={nproc!r}): the number of processes must be an integer >= 1")
    import cloudpickle

    payload = cloudpickle.dumps((fn, args))
    workdir = Path(tempfile.mkdtemp(prefix="unified_dist_launch_"))
    try:
        launcher_error: Optional[Exception] = None
        try:
            with _main_not_rerun_unless_a_file():
                SPECS[backend].load("start")(payload, nproc, backend, str(workdir))
        except Exception as exc:  # the stack's own report; the workers' error files say more
            launcher_error = exc
        failure = _failure(workdir, launcher_error)
        if failure is not None:
            raise failure from RemoteTraceback(failure.remote_traceback)
        with open(workdir / "result.pkl", "rb") as f:
            return pickle.load(f)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class RemoteTraceback(Exception):
    """The failed worker's traceback, shown as the cause of :class:`WorkerFailed` (as concurrent.futures does)."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0]) if self.args else ""


@contextmanager
def _main_not_rerun_unless_a_file() -> Iterator[None]:
    """Keep ``spawn``-ed children from re-running a ``__main__`` that is no file (``python - <<EOF``).

    A ``spawn`` child re-runs the parent's main script: multiprocessing.spawn's
    ``get_preparation_data`` sends ``__main__.__file__`` when ``__main__`` has no ``__spec__``, and
    the child's ``prepare`` hands it to ``runpy.run_path``. A script read on standard input has
    ``__file__ == "<stdin>"``, so every child died with FileNotFoundError, torch.multiprocessing's
    workers and ``horovod.run``'s middlemen (also ``spawn``) alike. Such a ``__main__`` cannot be
    re-run and the workers need nothing from it (``fn`` travels by value with cloudpickle), so its
    ``__file__`` is hidden while the stack runs, as ``python -c`` has none. A real script file is
    left alone and re-run as usual.
    """
    from multiprocessing import process

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    pseudo = isinstance(path, str) and path.startswith("<") and path.endswith(">")  # <stdin>, <string>
    if not isinstance(path, str) or getattr(main, "__spec__", None) is not None or (
            not pseudo and os.path.isfile(os.path.join(process.ORIGINAL_DIR or "", path))):
        yield  # re-run by module name, or a script file the children can read: multiprocessing's way
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def start_torch(payload: bytes, nproc: int, backend: str, workdir: str) -> None:
    """torch's and Accelerate's starter: torch.multiprocessing, each worker with torchrun-like variables."""
    import torch.multiprocessing as mp

    env = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    mp.start_processes(_torch_worker, args=(payload, backend, workdir, env), nprocs=nproc, join=True,
                       start_method="spawn")


def _torch_worker(local_rank: int, payload: bytes, backend: str, workdir: str, env: Dict[str, str]) -> None:
    _run_worker(payload, backend, workdir, dict(env, RANK=str(local_rank), LOCAL_RANK=str(local_rank)))


def start_horovod(payload: bytes, nproc: int, backend: str, workdir: str) -> None:
    """Horovod's starter: ``horovod.run`` with Gloo on this host."""
    try:
        import horovod
    except ImportError as exc:
        raise UnifiedDistError(f"launch(backend='horovod') needs horovod ({exc}); build it with `make setup`") from None
    horovod.run(_run_worker, args=(payload, backend, workdir, {}), num_proc=nproc, hosts=f"localhost:{nproc}",
                use_gloo=True)


def _run_worker(payload: bytes, backend: str, workdir: str, env: Dict[str, str]) -> None:
    """Inside a worker: take a launcher's identity, run the function, report its outcome."""
    import cloudpickle

    for key in [k for k in os.environ if _inherited(k, backend)]:
        del os.environ[key]
    os.environ.update(env)
    os.environ.update({ENV_BACKEND: backend, ENV_LAUNCHER: "ud.launch"})
    from . import facade

    rank = int(os.environ.get("RANK") or os.environ.get("HOROVOD_RANK") or 0)
    try:
        fn, args = cloudpickle.loads(payload)
        result = fn(*args)
        if rank == 0:
            _write_atomic(Path(workdir) / "result.pkl", cloudpickle.dumps(result))
        facade.shutdown()
    except BaseException as exc:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        summary = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1]
        _write_atomic(Path(workdir) / f"error-{rank}.pkl", pickle.dumps((summary, text, isinstance(exc, _SECONDARY))))
        raise


def _inherited(key: str, backend: str) -> bool:
    """A launcher variable of the caller's own job: not horovod.run's identity, not a unified_dist setting."""
    if key in (ENV_BACKEND, ENV_LAUNCHER):
        return True
    if key.startswith(PREFIX) or (backend == "horovod" and key.startswith("HOROVOD_")):
        return False
    return key.startswith(LAUNCHER_VARIABLE_PREFIXES) or key in TORCH_VARIABLES


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _failure(workdir: Path, launcher_error: Optional[BaseException]) -> Optional[WorkerFailed]:
    """The :class:`WorkerFailed` for the errors the workers wrote, root cause first."""
    errors: List[Tuple[bool, float, int, str, str]] = []
    for path in workdir.glob("error-*.pkl"):
        summary, text, secondary = pickle.loads(path.read_bytes())
        errors.append((secondary, path.stat().st_mtime, int(path.stem.split("-")[1]), summary, text))
    if not errors:
        if launcher_error is None:
            return None
        first = str(launcher_error).strip().splitlines()
        return WorkerFailed(f"a worker died without raising ({first[0] if first else type(launcher_error).__name__})",
                            rank=None, remote_traceback=str(launcher_error))
    _, _, rank, summary, text = min(errors)  # a real error before a peer's reaction to it
    return WorkerFailed(f"rank {rank} raised {summary}", rank=rank, remote_traceback=text)

