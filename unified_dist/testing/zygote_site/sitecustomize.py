"""The client of unified_dist/testing/zygote.py: a ``python`` that hands its run to a fork of the tests' server.

Imported by the interpreter at start-up when this folder is on ``PYTHONPATH``. Without ``UDTEST_ZYGOTE`` in
the environment, or loaded under another name (zygote.py and preloaded.py load it by its path for its rules), it
does nothing. With it, :func:`hand_over` checks that a fork of the server would start as this
process would (:func:`refusal`); if so it sends the run there and relays until the fork ends, then ends the same way
and never returns. Any refusal, or a server that cannot be reached, lets this interpreter go on as usual.
``UDTEST_ZYGOTE_LOG`` names a file that gets one line per decision (the tests' count of forks).
"""
import os

ENV_VARIABLE = "UDTEST_ZYGOTE"
FORWARDED = ("SIGHUP", "SIGINT", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGTERM", "SIGCONT", "SIGWINCH")
"""The signals relayed to the fork (``SIGKILL`` cannot be: the server kills the fork's session when this ends)."""
_IMPORT_PREFIXES = ("PYTHON", "_PYTHON_", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "CUDA", "NVIDIA",
                    "TORCH", "PYTORCH", "TRITON", "LC_", "LANG", "MALLOC", "TMPDIR", "NUMPY", "NPY_", "KINETO",
                    # torch._dynamo's and inductor's configuration, sympy and mpmath under them
                    "AOT", "INDUCTOR_", "FX_", "COMPILE_STROBELIGHT_", "CUTEDSL_", "CUTLASS_", "PARTITIONER_",
                    "SYMPY_", "MPMATH_",
                    # the transformers chain (huggingface_hub, accelerate, tqdm, PIL, psutil)
                    "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TQDM_", "PILLOW_", "PSUTIL_", "XLA_", "OAUTH_")
_NOT_AT_IMPORT = ("TORCHELASTIC_", "TORCH_NCCL_", "CUDA_VISIBLE_DEVICES", "PYTHONPATH")  # PYTHONPATH: see below
_IMPORT_NAMES = ("USER", "LOGNAME", "LNAME", "USERNAME", "HOME",  # torch's default cache folders name the user
                 "TMP", "TEMP", "CXX", "SAGE_ROOT", "DUMP_AOTI_MINIFIER", "ENABLE_PERSISTENT_TMA_MATMUL",
                 "ENABLE_TEMPLATE_TMA_STORE", "ENABLE_TMA_LOAD_FOR_TEMPLATE_EPILOGUE", "FAKE_ALLOW_META",
                 "LOG_AUTOTUNE_RESULTS", "LOG_TLPARSE", "PT2_COMPILE_ID_PREFIX", "UNSAFE_SKIP_FSDP_MODULE_GUARDS",
                 "XDG_CACHE_HOME", "LOGLEVEL", "COLUMNS", "LINES", "CI", "DISABLE_TELEMETRY", "DO_NOT_TRACK",
                 "EAGER_IMPORT", "OPENID_PROVIDER_URL", "CLAUDE_CONFIG_DIR", "NPU_FA2_SPARSE_MODE",
                 "SM_HP_MP_PARAMETERS", "USE_HUB_KERNELS", "USE_TORCH_XLA", "ACCELERATE_ENABLE_RICH",
                 "ACCELERATE_LOG_LEVEL", "ACCELERATE_USE_MEGATRON_LM")
SCANS = {"tqdm/utils.py": "TQDM_"}
"""Modules that read the whole environment at import, and the prefix of the variables they keep: their reads are
compared through that prefix (tests/unit/test_zygote.py traces the server's import and holds these lists to it)."""


APPLIED_BY_THE_FORK = ("PYTHONFAULTHANDLER",)
"""Variables the interpreter reads at start-up that the fork applies itself, from the client's value (zygote.py)."""
JOINABLE = ("net", "uts", "ipc", "mnt")
"""The namespaces a fork joins where its client's differ from the server's (``ip netns exec``, ``unshare --uts``: the
multinode tests' hosts): the client sends them, the fork enters them before it changes to the client's folder."""


def read_at_import(name):
    """Whether variable ``name`` may be read while the server imports its preload (torch, the Hugging Face chain) or
    by the interpreter at start-up: a client whose value differs from the server's starts fresh. The launchers' own
    variables (``RANK``, ``TORCHELASTIC_*``, ``SLURM_*``, ``OMPI_*``, ``ACCELERATE_MIXED_PRECISION``, ...) are read
    later, by the code a fork runs."""
    if name in _IMPORT_NAMES:
        return True
    if name in APPLIED_BY_THE_FORK:
        return False
    return name.startswith(_IMPORT_PREFIXES) and not name.startswith(_NOT_AT_IMPORT)


def differs_at_import(environ, theirs):
    """The first variable (by name) that :func:`read_at_import` says is read at import and whose value differs
    between the two environments, or ``None``."""
    for name in sorted(set(environ) | set(theirs)):
        if read_at_import(name) and environ.get(name) != theirs.get(name):
            return name
    return None


def parse(argv, unbuffered_env):
    """``(kind, target, args)`` for ``python [-u] SCRIPT|-m MODULE|-c CODE ARGS`` (``sys.orig_argv[1:]``), or a
    refusal (a string): other options change the interpreter itself. ``-u`` is taken only where the server's
    streams are unbuffered already (``PYTHONUNBUFFERED``)."""
    argv = list(argv)
    while argv and argv[0] == "-u":
        if not unbuffered_env:
            return "-u without PYTHONUNBUFFERED in the server"
        argv.pop(0)
    if not argv or argv[0] == "-":
        return "no script"
    if argv[0] in ("-m", "-c"):
        if len(argv) < 2:
            return f"{argv[0]} without its argument"
        return ("module" if argv[0] == "-m" else "code"), argv[1], argv[2:]
    if argv[0].startswith("-"):
        return f"interpreter option {argv[0]}"
    return "script", argv[0], argv[1:]


def python_path_entries(value, cwd):
    """The entries ``PYTHONPATH`` (``value``) puts on ``sys.path`` after its first, as the interpreter makes them in
    ``cwd``: an empty one is ``cwd``, a relative one is joined to it, each made absolute and normal, and a repeated
    one kept only the first time (``site.removeduppaths``). The server's forks rebuild ``sys.path`` with it too
    (zygote.py)."""
    entries = []
    for entry in value.split(os.pathsep) if value else []:
        path = os.path.abspath(os.path.join(cwd, entry))
        if path not in entries:
            entries.append(path)
    return entries


def _path_conflict(server, value, cwd):
    """Why the client's ``PYTHONPATH`` could not be the fork's, or ``None``. The fork rebuilds ``sys.path`` from
    it, so modules it imports resolve as the client's would; a module the server already imported must not lie
    in an entry the server did not have (the fresh interpreter would have imported that one)."""
    for entry in python_path_entries(value, cwd):
        name = _imported_elsewhere(server, entry)
        if name:
            return f"PYTHONPATH entry {entry} holds {name}, a module the server imported from elsewhere"
    return None


def _imported_elsewhere(server, folder):
    """A file or folder in ``folder`` named as a top-level module the server imported, where ``folder`` is not one
    of the server's ``PYTHONPATH`` entries (so the server's came from elsewhere), or ``None``."""
    if folder in python_path_entries(server["env"].get("PYTHONPATH"), server["cwd"]) or not os.path.isdir(folder):
        return None
    modules = set(server["modules"])
    for name in sorted(os.listdir(folder)):
        if name.split(".")[0] in modules and _importable(os.path.join(folder, name)):
            return name
    return None


def _importable(path):
    """Whether ``path`` is what an import of its name finds first in its folder: a module (``.py``, ``.pyc``, an
    extension) or a regular package (a folder with ``__init__.py``). A folder without it is a namespace portion, which
    a module or package later on ``sys.path`` still wins over, and a file without a suffix (a console script) is
    nothing an import reads."""
    if os.path.isdir(path):
        return os.path.exists(os.path.join(path, "__init__.py"))
    return path.endswith((".py", ".pyc", ".so", ".pyd"))


def places():
    """Where this process runs, as a fork inherits it from its server: its namespaces (network, host name, mounts,
    processes, ...: ``/proc/self/ns``) and its control groups (``/proc/self/cgroup``)."""
    folder = "/proc/self/ns"
    found = {name: os.readlink(os.path.join(folder, name)) for name in sorted(os.listdir(folder))} \
        if os.path.isdir(folder) else {}
    if os.path.exists("/proc/self/cgroup"):
        with open("/proc/self/cgroup") as handle:
            found["cgroups"] = handle.read()
    return found


def differing(server, here):
    """The names of :func:`places` where ``here`` (this process's) differs from the server's."""
    return [name for name in sorted(set(here) | set(server["places"])) if here.get(name) != server["places"].get(name)]


def refusal(server, environ, executable, argv, open_fds, here=None):
    """Why a fork of ``server`` (the server's ``SOCKET.json``) would not start as this process would, or the
    parsed command line. ``here``: this process's :func:`places` (read when not given)."""
    if os.path.realpath(executable) != os.path.realpath(server["executable"]):
        return f"another interpreter ({executable})"
    for name in differing(server, places() if here is None else here):
        if name not in JOINABLE or not server.get("can_join"):  # the fork would run outside this process's
            return f"another {'control group' if name == 'cgroups' else f'{name} namespace'} than the server's"
    theirs = server["env"]
    name = differs_at_import(environ, theirs)
    if name:
        return f"{name} differs from the server's"
    conflict = _path_conflict(server, environ.get("PYTHONPATH"), os.getcwd())
    if conflict:
        return conflict
    if open_fds:
        return f"inherited descriptors {open_fds}"  # multiprocessing's spawn, a launcher's pipes: the fork lacks them
    parsed = parse(argv, theirs.get("PYTHONUNBUFFERED"))
    if isinstance(parsed, str):
        return parsed
    first = os.path.dirname(os.path.abspath(parsed[1])) if parsed[0] == "script" else os.getcwd()  # sys.path[0]
    name = _imported_elsewhere(server, first)
    if name:
        return f"the run's first sys.path entry {first} holds {name}, a module the server imported from elsewhere"
    return parsed


def _log(line):
    path = os.environ.get("UDTEST_ZYGOTE_LOG")
    if path:
        with open(path, "a") as out:
            out.write(line + "\n")


def _open_fds():
    folder = "/proc/self/fd"
    found = []
    for name in os.listdir(folder):
        fd = int(name)
        if fd > 2:
            try:
                os.fstat(fd)  # listdir's own descriptor is closed by now
            except OSError:
                continue
            found.append(fd)
    return found


def hand_over():
    import json
    import signal
    import socket
    import struct
    import sys

    path = os.environ[ENV_VARIABLE]
    try:
        with open(path + ".json") as handle:
            server = json.load(handle)
    except (OSError, ValueError):
        return _log(f"fresh {sys.orig_argv[1:3]}: no server at {path}")
    here = places()
    parsed = refusal(server, os.environ, sys.executable, sys.orig_argv[1:], _open_fds(), here)
    if isinstance(parsed, str):
        return _log(f"fresh {sys.orig_argv[1:3]}: {parsed}")
    kind, target, args = parsed
    request_join = differing(server, here)  # joinable all, or refusal() said so
    signals = {name: ("ignore" if signal.getsignal(getattr(signal, name)) == signal.SIG_IGN else "default")
               for name in FORWARDED}
    request = json.dumps({"kind": kind, "target": target, "args": args, "cwd": os.getcwd(), "env": dict(os.environ),
                          "signals": signals, "orig_argv": sys.orig_argv, "join": request_join}).encode()
    data = struct.pack("!I", len(request)) + request
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        joined = [os.open(f"/proc/self/ns/{name}", os.O_RDONLY) for name in request_join]
        sent = socket.send_fds(conn, [data], [0, 1, 2, *joined])
        for fd in joined:
            os.close(fd)
        conn.sendall(data[sent:])
        reader = conn.makefile("rb")
        pid = json.loads(reader.readline())["pid"]
    except (OSError, ValueError, KeyError):
        conn.close()
        return _log(f"fresh {sys.orig_argv[1:3]}: the server did not take the run")
    try:  # the run is the fork's now: whatever happens here, this process never runs it too
        _log(f"fork {sys.orig_argv[1:3]}: pid {pid}")
        os._exit(_relay(pid, signals, reader))
    except BaseException as exc:  # noqa: BLE001
        os.write(2, f"zygote client: {exc!r}\n".encode())
        os._exit(1)


def _relay(pid, signals, reader):
    """Relay signals to the fork ``pid`` until the server says how it ended; end the same way (the exit status
    returned, or this process killed by the fork's signal)."""
    import json
    import signal

    def relay(number, frame):
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass

    for name, how in signals.items():
        if how == "default":
            signal.signal(getattr(signal, name), relay)
    try:
        ended = json.loads(reader.readline() or b"{}")
    except (OSError, ValueError):
        ended = {}
    if "signal" in ended:
        number = ended["signal"]
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(number, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [number])
        os.kill(os.getpid(), number)
        return 128 + number  # a signal whose default is not to end a process
    if "exit" not in ended:
        os.write(2, b"zygote: the server ended before the run did\n")
        return 1
    return ended["exit"]


if __name__ == "sitecustomize" and os.environ.get(ENV_VARIABLE):  # loaded by its path (zygote.client): rules only
    hand_over()
