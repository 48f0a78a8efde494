"""A fork server for the tests' launched Python processes: torch imported once, each ``python`` a fork of it.

    python unified_dist/testing/zygote.py SOCKET

Run as a script (never as ``unified_dist.testing.zygote``): its children must not find this package already
imported under the server's environment. The server imports :data:`PRELOAD`, refuses to serve if that left a second
thread (a fork copies only the forking one; ``OMP_NUM_THREADS=1`` keeps numpy's OpenBLAS from starting its pool),
writes ``SOCKET.json`` (its interpreter, its environment, its pid) and listens on ``SOCKET``.

The client is ``zygote_site/sitecustomize.py``: a ``python`` started with ``UDTEST_ZYGOTE=SOCKET`` in its
environment and ``zygote_site`` first on ``PYTHONPATH`` sends its command line, working folder, environment and
standard streams (file descriptors 0, 1, 2) here, and then only relays: the signals it receives go to the fork, and
it ends as the fork ended (its exit status, or killed by the same signal). It hands over only when nothing the fork
inherited would differ from a fresh start: same interpreter, same variables that are read while torch is imported
(``read_at_import`` there), a command line of the forms ``python [-u] SCRIPT|-m MODULE|-c CODE ARGS``. Otherwise it
starts as any ``python`` does.

Each fork does what ``python`` would: a session of its own, the client's streams, its network, host-name, IPC and mount
namespaces where they differ from the server's (the client sends them; the server must be root, else such a client
starts fresh), its folder and environment, the signal dispositions the client was started with, ``sys.argv``,
``sys.orig_argv`` and ``sys.path[0]`` as the interpreter sets them, the script run as a fresh ``__main__``
(:func:`run_as_python`), Python's, numpy's and torch's random generators seeded from the system (forks would otherwise
share one sequence), ``tempfile``'s cached folder forgotten. It ends through the interpreter's own finalization (its
threads joined, ``atexit``, garbage collected, the libraries' destructors run), as a fresh one would, so that a crash
at exit shows. The server freezes what its imports made (``gc.freeze``): the forks' collections skip it. What a fork
shares with the others is what importing :data:`PRELOAD` left in memory, and what a fresh interpreter would not share:
the hash seed of ``str`` (``PYTHONHASHSEED``), chosen once for the server, and what the kernel shows of it (its parent,
its ``/proc/PID/cmdline`` and ``environ`` are the server's). Tests whose claim is about a process's own start, exit or
signals run on fresh interpreters (pytest marker ``fresh_python``).

When the client dies (``SIGKILL``: a launcher's or a test's timeout), the server kills the fork's whole session.
``SOCKET.cpu`` holds the user and system CPU seconds of every fork that ended, so the tests' launch log counts
forks' work as it counts children's.

Why: on 2 cores, importing torch and ``torch._dynamo`` costs each launched process about 3.5 CPU-seconds, and the
example's processes spend 2 more importing transformers; the suite starts about a thousand of them.
"""
from __future__ import annotations

import functools
import json
import os
import selectors
import signal
import socket
import struct
import sys
from typing import Dict, List, Optional

PRELOAD = ("torch", "torch._dynamo", "transformers", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.models.bert.modeling_bert",
           "transformers.data.data_collator")
"""Imported once by the server, before the first fork: torch, and the transformers chain the example's processes
import (about 2 CPU-seconds more each, on top of torch's 3.5). Not ``datasets``: pyarrow's import starts a thread
(jemalloc's), and a fork has only the forking thread."""

def _exit_status(exc: SystemExit) -> int:
    """The status ``python`` exits with for an uncaught ``SystemExit``: its int code, 0 for ``None``, else 1 after
    printing the code to stderr."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def run_as_python(kind: str, target: str, args: List[str], finalize: bool = True) -> int:
    """Run what ``python SCRIPT ARGS`` (``kind`` ``"script"``), ``python -m MODULE ARGS`` (``"module"``) or
    ``python -c CODE ARGS`` (``"code"``) runs, in this process (already in the run's folder and environment): a
    fresh ``__main__``, ``sys.argv`` and ``sys.path[0]`` as the interpreter sets them, the exit status the
    interpreter would give (1 and the traceback after an uncaught exception). With ``finalize``, then what an
    interpreter does before it exits: wait for non-daemon threads, run ``atexit`` functions, flush the streams
    (the caller ends with ``os._exit``). Without, the caller exits through the interpreter's own finalization,
    which does all that and the rest (garbage collection, the libraries' C++ destructors, where a crash at exit
    shows); an uncaught ``KeyboardInterrupt`` is raised again after its traceback, so that the interpreter ends
    the process by ``SIGINT`` as it would."""
    import atexit
    import importlib.machinery
    import runpy
    import threading
    import traceback
    import types

    try:
        if kind == "module":
            sys.argv = ["-m", *args]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(target, alter_argv=True)  # what `python -m` calls
        else:
            main = types.ModuleType("__main__")  # what the interpreter makes of a script or of -c
            if kind == "script":
                script = os.path.abspath(target)
                sys.argv = [target, *args]
                sys.path[0] = os.path.dirname(os.path.realpath(script))
                main.__file__ = script
                main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
                with open(script, "rb") as handle:
                    code = compile(handle.read(), script, "exec")
            else:
                sys.argv = ["-c", *args]
                sys.path[0] = ""
                main.__loader__ = importlib.machinery.BuiltinImporter
                code = compile(target, "<string>", "exec")
            sys.modules["__main__"] = main  # pickle and multiprocessing's spawn find the script's functions here
            exec(code, main.__dict__)
        status = 0
    except SystemExit as exc:
        status = _exit_status(exc)
    except BaseException as exc:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
            tb = tb.tb_next  # the traceback starts in the script, as the interpreter's does
        traceback.print_exception(type(exc), exc, tb)
        status = 1
        if isinstance(exc, KeyboardInterrupt) and not finalize:
            sys.excepthook = lambda *info: None  # printed above, from the script's first frame
            raise
    if not finalize:
        return status
    try:
        threading._shutdown()  # the interpreter waits for non-daemon threads before its atexit functions
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        status = status or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return status


def _fresh_state() -> None:
    """What a fresh interpreter would have that a fork of the server does not: its own random sequences, no cached
    temporary folder, its own multiprocessing key."""
    # Python's random reseeds itself in a fork (os.register_at_fork); numpy's and torch's do not
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()  # a fresh torch seeds its generator from the system too
    if "tempfile" in sys.modules:
        sys.modules["tempfile"].tempdir = None
    if "multiprocessing" in sys.modules:
        sys.modules["multiprocessing"].current_process().authkey = os.urandom(32)


@functools.lru_cache(maxsize=None)
def client():
    """The client's module (zygote_site/sitecustomize.py), loaded by its path once, in the server (the forks
    inherit it): its ``python_path_entries`` is the one rule for ``sys.path`` on both sides, its ``differs_at_import``
    the one rule for the variables torch's import reads (preloaded.py's too). Loading it does nothing else here (the
    server has no ``UDTEST_ZYGOTE``)."""
    import importlib.util

    where = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote_site", "sitecustomize.py")
    spec = importlib.util.spec_from_file_location("_unified_dist_zygote_client", where)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _child(request: Dict, fds: List[int], effects: Dict[str, str], tail: List[str]) -> int:
    """In the fork (the server's sockets closed): become what the client would have been, run it; its exit status,
    for the interpreter's own exit. ``effects``: the variables importing :data:`PRELOAD` set in the server, set here
    too where the client's environment lacks them, as its own import would have (from the same variables: the
    client's are the server's where they are read at import). ``tail``: the server's ``sys.path`` after its
    ``PYTHONPATH`` entries (the standard library, site-packages), behind the client's own entries."""
    os.setsid()
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    for name, fd in zip(request["join"], fds[3:]):  # before the folder: entering a mount namespace resets it
        try:
            _setns(fd)
        except OSError as exc:
            print(f"zygote: the fork could not enter its client's {name} namespace ({exc})", file=sys.stderr)
            return 1
        os.close(fd)
    for name, how in request["signals"].items():
        number = getattr(signal, name)
        if how == "ignore":
            signal.signal(number, signal.SIG_IGN)
        elif number == signal.SIGINT:
            signal.signal(number, signal.default_int_handler)
        else:
            signal.signal(number, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    entries = client().python_path_entries(os.environ.get("PYTHONPATH"), request["cwd"])
    sys.path[:] = [sys.path[0], *entries, *(path for path in tail if path not in entries)]  # as site dedupes
    for name, value in effects.items():
        os.environ.setdefault(name, value)
    import faulthandler

    if os.environ.get("PYTHONFAULTHANDLER"):  # what the interpreter does at start-up (APPLIED_BY_THE_FORK)
        faulthandler.enable()
    else:
        faulthandler.disable()
    sys.orig_argv = request["orig_argv"]  # the command line as typed (the server's otherwise)
    _fresh_state()
    if sys.stdout is not None:
        sys.stdout.reconfigure(line_buffering=os.isatty(1))
    return run_as_python(request["kind"], request["target"], request["args"], finalize=False)


def _setns(fd: int) -> None:
    """Enter the namespace ``fd`` refers to (``setns(2)``; ``os.setns`` is Python 3.12's)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, 0) != 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number))


def _send(conn: Optional[socket.socket], message: Dict) -> None:
    if conn is None:
        return
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass


def _receive(conn: socket.socket):
    """A request: 4 bytes of length, JSON, with the client's three descriptors on the first chunk, then one for each
    namespace the fork is to join (the request's ``join``)."""
    conn.settimeout(10)
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3 + len(client().JOINABLE))
    if len(data) < 4 or len(fds) < 3:
        for fd in fds:
            os.close(fd)
        raise OSError("malformed request")
    (size,) = struct.unpack("!I", data[:4])
    data = data[4:]
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise OSError("client left mid-request")
        data += more
    conn.settimeout(None)
    request = json.loads(data)
    if len(fds) != 3 + len(request.get("join", ())):
        for fd in fds:
            os.close(fd)
        raise OSError("malformed request")
    return request, fds


def kill_group(pid: int) -> None:
    """SIGKILL the process group that ``pid`` leads (a fork, or a preloaded run: each calls ``setsid`` first), or
    ``pid`` alone where it has not yet."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)  # killed before its setsid
        except ProcessLookupError:
            pass


def serve(path: str) -> int:
    before = dict(os.environ)
    for module in PRELOAD:
        __import__(module)
    effects = {k: v for k, v in os.environ.items() if before.get(k) != v}  # torch sets TORCHINDUCTOR_CACHE_DIR
    entries = client().python_path_entries(before.get("PYTHONPATH"), os.getcwd())
    assert sys.path[1:1 + len(entries)] == entries, (sys.path, entries)
    tail = sys.path[1 + len(entries):]
    top_level = sorted({name.partition(".")[0] for name in sys.modules})
    import gc

    gc.freeze()  # what the imports made stays out of the forks' collections (and their pages shared)
    threads = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["one"]
    if len(threads) != 1:
        print(f"zygote: importing {', '.join(PRELOAD)} left {len(threads)} threads (set OMP_NUM_THREADS=1): a fork "
              "would lose them; not serving", file=sys.stderr)
        return 2
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    listener.bind(path)
    listener.listen(64)
    parent = os.getppid()
    with open(path + ".cpu", "w") as out:
        out.write("0.0")
    with open(path + ".json.tmp", "w") as out:
        json.dump({"executable": sys.executable, "env": before, "pid": os.getpid(), "cwd": os.getcwd(),
                   "modules": top_level, "places": client().places(), "can_join": os.geteuid() == 0}, out)
    os.replace(path + ".json.tmp", path + ".json")  # clients read it whole or not at all
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    conns: Dict[int, Optional[socket.socket]] = {}  # fork's pid -> its client's connection (None once it left)
    owner: Dict[int, int] = {}  # connection's fd -> fork's pid
    cpu = 0.0
    while True:
        for key, _ in selector.select(timeout=0.02):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # the fork: it leaves this loop with the run's status, and the interpreter exits
                    for other in (conn, listener, selector, *conns.values()):
                        if other is not None:
                            other.close()
                    return _child(request, fds, effects, tail)
                for fd in fds:
                    os.close(fd)
                conns[pid] = conn
                owner[conn.fileno()] = pid
                selector.register(conn, selectors.EVENT_READ)
                _send(conn, {"pid": pid})
            else:  # a client's connection readable: it left (it never writes after its request)
                conn = key.fileobj
                pid = owner.pop(conn.fileno())
                selector.unregister(conn)
                conn.close()
                if conns.get(pid) is conn:
                    conns[pid] = None
                    kill_group(pid)
        while conns:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            cpu += usage.ru_utime + usage.ru_stime
            with open(path + ".cpu.tmp", "w") as out:
                out.write(repr(cpu))
            os.replace(path + ".cpu.tmp", path + ".cpu")
            conn = conns.pop(pid, None)
            if conn is not None:
                if os.WIFSIGNALED(status):
                    _send(conn, {"signal": os.WTERMSIG(status)})
                else:
                    _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                owner.pop(conn.fileno(), None)
                selector.unregister(conn)
                conn.close()
        if os.getppid() != parent:  # the test process that started this one is gone
            for pid in conns:
                kill_group(pid)
            return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
