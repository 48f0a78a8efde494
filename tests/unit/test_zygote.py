"""unified_dist/testing/zygote.py and its client: a ``python`` handed to the fork server runs as a fresh one would.

The expectations are a fresh interpreter's: each script below runs twice, once as ``python`` always starts (the
same environment without ``UDTEST_ZYGOTE``: the client does nothing) and once handed to a server of this module's
own; what the two print, their exit statuses and their stderr must be equal. The decision log
(``UDTEST_ZYGOTE_LOG``) shows which runs were forks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from unified_dist.testing import zygote
from unified_dist.testing.launchers import start_zygote, unavailable, zygote_env

pytestmark = [pytest.mark.distributed, pytest.mark.fresh_python]  # this module's own server and its forks

SCRIPTS = {
    "identity": """
        import json, os, sys
        print(json.dumps({"argv": sys.argv, "orig_argv": sys.orig_argv, "cwd": os.getcwd(), "path": sys.path,
                          "name": __name__,
                          "file": globals().get("__file__"), "mine": os.environ.get("MINE"),
                          "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR") is not None}))
        """,
    "exit_3": "import sys\nprint('before')\nsys.exit(3)\n",
    "exit_text": "raise SystemExit('bad input')\n",
    "raises": "def f():\n    raise ValueError('deep')\nf()\n",
    "no_import": "x = torch.ones(1)\n",  # the fork's globals are the script's: NameError as alone
    "atexit_thread": textwrap.dedent("""
        import atexit, threading, time
        atexit.register(lambda: print('at exit ran', flush=True))
        threading.Thread(target=lambda: (time.sleep(0.3), print('thread ended', flush=True))).start()
        print('main ended', flush=True)
        """),
    "torch_start": "import torch\nprint(torch.get_num_threads(), torch.get_default_dtype(), torch.ones(3).sum())\n",
    "stdin": "print(input().upper())\n",
    "killed": "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n",
    "interrupted": "raise KeyboardInterrupt\n",  # the interpreter ends itself by SIGINT after the traceback
    "finalized": "class Held:\n    def __del__(self):\n        print('finalized', flush=True)\nheld = Held()\n",
    "signals": "import signal\nprint(repr(signal.getsignal(signal.SIGTERM)), repr(signal.getsignal(signal.SIGINT)))\n",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zygote")
    env = zygote_env()
    path = str(folder / "s")
    process = start_zygote(env, str(folder))
    yield {"env": env, "path": path, "log": folder / "log.txt", "folder": folder}
    process.kill()
    process.wait()


def _run(server, name, code, handed, args=(), extra=None, cwd=None, **kwargs):
    folder = server["folder"] / name
    folder.mkdir(exist_ok=True)
    (folder / "script.py").write_text(textwrap.dedent(code))
    env = {**server["env"], **(extra or {})}
    if handed:  # else the client's sitecustomize is imported too, and does nothing: the interpreter as it is
        env.update(UDTEST_ZYGOTE=server["path"], UDTEST_ZYGOTE_LOG=str(server["log"]))
    cmd = kwargs.pop("cmd", None) or [sys.executable, "script.py", *args]
    return subprocess.run(cmd, cwd=cwd or folder, env=env, capture_output=True, text=True, timeout=120, **kwargs)


def _log(server):
    return server["log"].read_text().splitlines() if server["log"].exists() else []


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_handed_run_prints_exits_and_fails_as_a_fresh_interpreter(server, name):
    extra = {"MINE": "1"}
    stdin = "hello\n" if name == "stdin" else None
    before = len(_log(server))
    fresh = _run(server, name, SCRIPTS[name], False, ["--flag", "v"], extra, input=stdin)
    forked = _run(server, name, SCRIPTS[name], True, ["--flag", "v"], extra, input=stdin)
    assert [line.split(":")[0] for line in _log(server)[before:]] == ["fork ['script.py', '--flag']"]
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


def test_module_and_code_forms_get_the_interpreters_argv_and_path(server):
    show = "import json, sys; print(json.dumps([sys.argv, sys.orig_argv, sys.path[0], __name__]))"
    (server["folder"] / "shown.py").write_text(show + "\n")
    for cmd in ([sys.executable, "-c", show, "a", "b"], [sys.executable, "-u", "-m", "shown", "x"]):
        fresh = _run(server, "forms", "", False, cmd=cmd, cwd=server["folder"])
        forked = _run(server, "forms", "", True, cmd=cmd, cwd=server["folder"])
        assert fresh.returncode == 0, fresh.stderr
        assert (forked.returncode, forked.stdout, forked.stderr) == (0, fresh.stdout, fresh.stderr)
    assert sum(line.startswith("fork ['-") for line in _log(server)) >= 2


def test_random_sequences_are_each_processs_own(server):
    code = "import random, numpy, torch\nprint(random.random(), numpy.random.rand(), torch.initial_seed())\n"
    outs = [_run(server, "random", code, True).stdout.split() for _ in range(3)]
    for generator in range(3):  # a fresh interpreter seeds each from the system; forks of one server must not share
        assert len({out[generator] for out in outs}) == 3, outs


def test_a_signal_to_the_client_reaches_the_run_and_its_exit_is_the_clients(server):
    folder = server["folder"] / "term"
    folder.mkdir()
    (folder / "script.py").write_text(textwrap.dedent("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: (print('got term', flush=True), sys.exit(7)))
        print('ready', flush=True)
        time.sleep(60)
        """))
    env = {**server["env"], "UDTEST_ZYGOTE": server["path"]}
    client = subprocess.Popen([sys.executable, "script.py"], cwd=folder, env=env, stdout=subprocess.PIPE, text=True)
    assert client.stdout.readline() == "ready\n"
    client.send_signal(signal.SIGTERM)
    assert client.wait(30) == 7 and client.stdout.read() == "got term\n"


def test_a_killed_client_takes_its_run_and_the_runs_children_with_it(server):
    folder = server["folder"] / "kill"
    folder.mkdir()
    (folder / "script.py").write_text(textwrap.dedent("""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print(os.getpid(), child.pid, flush=True)
        time.sleep(120)
        """))
    env = {**server["env"], "UDTEST_ZYGOTE": server["path"]}
    client = subprocess.Popen([sys.executable, "script.py"], cwd=folder, env=env, stdout=subprocess.PIPE, text=True)
    pids = [int(word) for word in client.stdout.readline().split()]
    assert client.pid not in pids  # the run is a fork of the server, not the client itself
    client.kill()
    assert client.wait(30) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
              for pid in pids):
        assert time.monotonic() < deadline, "the run or its child outlived its client"
        time.sleep(0.1)


def test_an_ignored_signal_stays_ignored_in_the_run(server):
    def ignore():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    fresh = _run(server, "ignored", SCRIPTS["signals"], False, preexec_fn=ignore)
    forked = _run(server, "ignored", SCRIPTS["signals"], True, preexec_fn=ignore)
    assert fresh.stdout.startswith("<Handlers.SIG_IGN: 1> ") and forked.stdout == fresh.stdout


@pytest.mark.parametrize("why", ["variable", "descriptor", "option"])
def test_a_run_a_fork_would_start_differently_starts_fresh(server, why):
    before = len(_log(server))
    code = "import sys\nprint('torch' in sys.modules)\n"
    if why == "variable":
        got = _run(server, "refused", code, True, extra={"OMP_NUM_THREADS": "2"})
    elif why == "descriptor":
        read, write = os.pipe()
        got = _run(server, "refused", code, True, pass_fds=(read,))
        os.close(read)
        os.close(write)
    else:
        got = _run(server, "refused", "", True, cmd=[sys.executable, "-X", "dev", "-c", code.replace("\n", ";")])
    assert got.returncode == 0 and got.stdout == "False\n", got.stderr  # torch not in memory: a fresh start
    reason = {"variable": "OMP_NUM_THREADS differs from the server's", "descriptor": "inherited descriptors",
              "option": "interpreter option -X"}[why]
    assert [line.startswith("fresh") and reason in line for line in _log(server)[before:]] == [True]


def test_the_server_counts_the_cpu_of_the_forks_that_ended(server):
    before = float(Path(server["path"] + ".cpu").read_text())
    _run(server, "busy", "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n", True)
    time.sleep(0.2)
    assert float(Path(server["path"] + ".cpu").read_text()) - before >= 0.5


def test_the_refusals_name_the_difference():
    client = zygote.client()
    server = {"executable": sys.executable, "env": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, "cwd": "/",
              "modules": ["torch"], "places": client.places()}
    same = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RANK": "3", "TORCHELASTIC_RUN_ID": "x"}
    assert client.refusal(server, same, sys.executable, ["-u", "w.py", "a"], []) == ("script", "w.py", ["a"])
    assert client.refusal(server, {**same, "TORCH_LOGS": "+dynamo"}, sys.executable, ["w.py"], []) == (
        "TORCH_LOGS differs from the server's")
    assert client.refusal(server, same, "/usr/bin/python3.9", ["w.py"], []).startswith("another interpreter")
    assert client.refusal(server, same, sys.executable, ["-O", "w.py"], []) == "interpreter option -O"
    assert client.refusal(server, same, sys.executable, [], []) == "no script"
    assert json.dumps(client.refusal(server, same, sys.executable, ["-m", "torch.distributed.run", "--x"], [])) == (
        '["module", "torch.distributed.run", ["--x"]]')
    assert client.refusal(server, same, sys.executable, ["w.py"], [], here={**server["places"], "pid": "pid:[1]"}) == (
        "another pid namespace than the server's")
    elsewhere = {**server["places"], "net": "net:[1]"}  # joined by the fork where the server may (as root)
    assert client.refusal(dict(server, can_join=True), same, sys.executable, ["w.py"], [], here=elsewhere) == (
        "script", "w.py", [])
    assert client.refusal(dict(server, can_join=False), same, sys.executable, ["w.py"], [], here=elsewhere) == (
        "another net namespace than the server's")


def test_a_pythonpath_of_its_own_is_the_runs_sys_path_unless_it_holds_a_module_the_server_imported(server):
    """Launchers put folders of their own first on PYTHONPATH (unified-dist's self-test, Horovod's redirect): the fork
    rebuilds sys.path from the client's PYTHONPATH and folder, as the interpreter does (an empty entry is the folder
    the process starts in); a folder that holds a module the server already imported makes the run start fresh."""
    extra = server["folder"] / "extra"
    extra.mkdir()
    (extra / "helper.py").write_text("WHERE = 'extra'\n")
    (server["folder"] / "here.py").write_text("WHERE = 'cwd'\n")
    code = "import sys, helper, here\nprint(helper.WHERE, here.WHERE, sys.path)\n"
    path = {"PYTHONPATH": f"{extra}{os.pathsep}{extra}{os.pathsep}{server['env']['PYTHONPATH']}"}  # site dedupes
    assert path["PYTHONPATH"].endswith(os.pathsep)  # the launches' own: an empty last entry, the start folder
    before = len(_log(server))
    cmd = [sys.executable, "paths/script.py"]
    fresh = _run(server, "paths", code, False, extra=path, cwd=server["folder"], cmd=cmd)
    forked = _run(server, "paths", code, True, extra=path, cwd=server["folder"], cmd=cmd)
    assert fresh.returncode == 0, fresh.stderr
    assert [line.split(":")[0] for line in _log(server)[before:]] == ["fork ['paths/script.py']"]
    assert forked.stdout.startswith("extra cwd ") and forked.stdout == fresh.stdout
    (extra / "numpy.py").write_text("raise SystemExit('the fresh interpreter imports this one')\n")
    shadowed = _run(server, "paths", "import numpy\n", True, extra=path, cwd=server["folder"], cmd=cmd)
    assert shadowed.stderr == "the fresh interpreter imports this one\n"
    assert "holds numpy.py, a module the server imported from elsewhere" in _log(server)[-1]


def test_a_script_beside_a_module_the_server_imported_starts_fresh(server):
    """A fresh interpreter puts the script's folder first on sys.path (the start folder for -m and -c): a module
    there that the server imported from elsewhere is the one a fresh run imports, so the run starts fresh."""
    before = len(_log(server))
    folder = server["folder"] / "beside"
    folder.mkdir()
    (folder / "torch").write_text("#!/bin/sh\n")  # a console script (bin/ holds torchrun beside accelerate's)
    (folder / "transformers").mkdir()  # a namespace portion: the server's regular package wins over it
    scripts = _run(server, "beside", "import torch, transformers\nprint('imported')\n", True, cwd=server["folder"],
                   cmd=[sys.executable, "beside/script.py"])
    assert scripts.stdout == "imported\n", scripts.stderr
    (folder / "numpy.py").write_text("raise SystemExit('the fresh interpreter imports this one')\n")
    beside = _run(server, "beside", "import numpy\n", True, cwd=server["folder"],
                  cmd=[sys.executable, "beside/script.py"])
    own = {"PYTHONPATH": server["env"]["PYTHONPATH"].rstrip(os.pathsep)}  # the launches' has the start folder too
    in_cwd = _run(server, "beside", "", True, extra=own, cmd=[sys.executable, "-c", "import numpy"])
    assert beside.stderr == in_cwd.stderr == "the fresh interpreter imports this one\n"
    assert [line.startswith("fresh") and f"first sys.path entry {folder} holds numpy.py" in line
            for line in _log(server)[before:]] == [False, True, True]
    assert _log(server)[before].startswith("fork ['beside/script.py']")


TRACE = """
import json, os, sys, traceback
sys.path.insert(0, sys.argv[1])
import zygote
known, reads, scans, tracing = zygote.client().SCANS, set(), set(), [False]

def where():
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename
        if tracing[0] and not name.startswith("<frozen") and not name.endswith(("/os.py", "/_collections_abc.py")):
            return name.split("site-packages/")[-1]
    return None

class Traced(os._Environ):
    def __getitem__(self, key):
        site = where()
        if site and site not in known:
            reads.add(key)
        return super().__getitem__(key)

    def __iter__(self):
        site = where()
        if site:
            scans.add(site)
        return super().__iter__()

e = os.environ
os.environ = Traced(e._data, e.encodekey, e.decodekey, e.encodevalue, e.decodevalue)
tracing[0] = True
for module in zygote.PRELOAD:
    __import__(module)
tracing[0] = False
print(json.dumps({"reads": sorted(reads), "scans": sorted(scans)}))
"""


def test_every_variable_the_preload_reads_is_one_the_client_compares(tmp_path):
    """The server's import of its preload, traced through ``os.environ``: every variable read by Python code is one
    the client compares with the server's (``read_at_import``), and a module that reads the whole environment is one
    of the client's ``SCANS``, whose prefix it compares. A fork would otherwise run with the server's reading of a
    variable its client set differently. (What C code reads, torch's own, the client's prefixes cover by hand.)"""
    client = zygote.client()
    env = {k: v for k, v in zygote_env().items() if k != "UDTEST_ZYGOTE"}
    got = subprocess.run([sys.executable, "-c", TRACE, str(Path(__file__).parents[2] / "unified_dist" / "testing")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    traced = json.loads(got.stdout.splitlines()[-1])
    assert "HF_HUB_OFFLINE" in traced["reads"] and "TORCHINDUCTOR_CACHE_DIR" in traced["reads"]  # the trace works
    assert [name for name in traced["reads"] if not client.read_at_import(name)] == []
    assert set(traced["scans"]) <= set(client.SCANS)
    assert all(client.read_at_import(prefix + "ANY") for prefix in client.SCANS.values())


def test_a_python_started_in_another_network_namespace_runs_in_it(server):
    """The multinode tests start each host's processes under ``ip netns exec`` (its own network and mounts) and
    ``unshare --uts`` (its own host name): the fork enters the client's namespaces, so it sees what a fresh
    interpreter started there sees."""
    if os.geteuid() != 0 or subprocess.run(["ip", "netns", "add", "udtest_zygote"], capture_output=True).returncode:
        unavailable("cannot make a network namespace here (root and iproute2 needed)")
    try:
        before = len(_log(server))
        code = ("import os, socket\nprint(os.readlink('/proc/self/ns/net'), socket.gethostname(), os.getcwd(), "
                "sorted(os.listdir('/sys/class/net')))\n")
        cmd = ["ip", "netns", "exec", "udtest_zygote", "unshare", "--uts", "--", "sh", "-c",
               'hostname udtest-h1 && exec "$@"', "sh", sys.executable, "script.py"]
        fresh = _run(server, "namespace", code, False, cmd=cmd)
        forked = _run(server, "namespace", code, True, cmd=cmd)
    finally:
        subprocess.run(["ip", "netns", "del", "udtest_zygote"], capture_output=True)
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stdout.split()[0] != os.readlink("/proc/self/ns/net") and fresh.stdout.split()[1] == "udtest-h1"
    assert forked.stdout == fresh.stdout, forked.stderr
    assert [line.split(":")[0] for line in _log(server)[before:]] == ["fork ['script.py']"]


@pytest.mark.parametrize("value", ["1", ""])
def test_pythonfaulthandler_is_the_clients_in_the_fork(server, value):
    """The interpreter reads PYTHONFAULTHANDLER at its start; the fork applies the client's value itself."""
    before = len(_log(server))
    code = "import faulthandler\nprint(faulthandler.is_enabled())\n"
    fresh = _run(server, "faults", code, False, extra={"PYTHONFAULTHANDLER": value})
    forked = _run(server, "faults", code, True, extra={"PYTHONFAULTHANDLER": value})
    assert fresh.stdout == forked.stdout == f"{bool(value)}\n", (fresh.stderr, forked.stderr)
    assert [line.split(":")[0] for line in _log(server)[before:]] == ["fork ['script.py']"]
