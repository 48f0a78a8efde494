"""Several of Accelerate's own test scripts (``accelerate/test_utils/scripts``, as installed, no line changed) in
one launch: ``LAUNCHER python -m unified_dist.accelerate accelerate_own_scripts.py WORKDIR SCRIPT...``
(tests/launchers/test_accelerate_own_scripts.py).

Each script is imported from Accelerate's folder, then its ``main()`` runs, as ``python SCRIPT.py`` would run
it. Between two scripts each process is put back as a fresh process would be: Accelerate's process-wide state
reset, torch's generator at its initial seed. The process group is the exception: every script destroys it at
its end, and forming it again on the same rendezvous within one process is not what these scripts test, so
Accelerate's ``destroy_process_group`` does nothing while they run (the runner destroys the group at exit).

Accelerate's ``RegressionDataset`` draws its data from the operating system's entropy when given no seed (other
data in every process of every run), and ``test_sync``'s ``test_distributed_sync`` compares float32 gradients
with ``torch.allclose``'s default ``rtol=1e-5``: a draw whose gradient nearly cancels fails it under any
launcher, Accelerate's own included (CI's run of 0edf103, under mpirun: 0.0085592 against 0.0085593, a float32
rounding of terms near 8). Here each such dataset gets a seed from the script, the rank and its order, so every
run and every launcher sees the same data, and a failure reproduces. A seed the script gives is kept.

A function of the script named ``test_*``, ``check_*`` or ``*_check`` that ``main()`` calls itself is one of the
script's tests (those it calls in turn are parts of it). Every process prints one line per script::

    own-scripts SCRIPT rank R of N: P passed (S s): NAME NAME ...

or, on the first failure, ``own-scripts SCRIPT rank R of N: FAILED in NAME after P passed: ERROR``, the
traceback, and exits 1 at once (the launcher stops the other processes, which would wait for it). A script
still running after ``BUDGET`` seconds (a hang: ranks that left a collective unanswered) dumps every thread's
stack, which names the test it hangs in, and exits 1.
"""
import faulthandler
import functools
import importlib.util
import os
import re
import sys
import time
import traceback
import zlib
from pathlib import Path

import accelerate
import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState
from accelerate.test_utils.training import RegressionDataset

import unified_dist.accelerate
from unified_dist.detection import detect

SCRIPTS = Path(accelerate.__file__).parent / "test_utils" / "scripts"
A_TEST = re.compile(r"^(test_|check_)|_check$")
BUDGET = 300  # seconds per script; each took under 60 on 2 busy cores (load 19)
FRESH_SEED = torch.initial_seed()  # what torch's generator starts from in every new process
REAL_DATASET_INIT = RegressionDataset.__init__


class Tally:
    """The tests ``main()`` calls itself, in order, and the one running."""

    def __init__(self):
        self.passed = []
        self.running = None
        self._depth = 0

    def count(self, name, function):
        @functools.wraps(function)
        def counted(*args, **kwargs):
            if self._depth == 0:
                self.running = name
            self._depth += 1
            try:
                result = function(*args, **kwargs)
            finally:
                self._depth -= 1
            if self._depth == 0:
                self.passed.append(name)
            return result

        return counted


def load(name, tally):
    """Accelerate's script ``name`` as a module, its tests counted by ``tally``."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its classes pickle by name (test_pickle_accelerator)
    spec.loader.exec_module(module)
    for attr, value in list(vars(module).items()):
        if callable(value) and getattr(value, "__module__", None) == name and A_TEST.search(attr):
            setattr(module, attr, tally.count(attr, value))
    return module


def say(line: str) -> None:
    """``line`` and its newline in one write(2) of the raw stdout: the launcher merges both ranks' output in one
    pipe, and ``print`` under ``python -u`` writes the text and the newline apart, so the other rank's line could
    land between them (a fresh run's torchrun launch failed its ``...$`` match so, with every test passed). One
    write of under PIPE_BUF (4096) bytes to a pipe is never split."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line[:4000] + "\n").encode())


def where():
    """``rank R of N`` from the process group; ``rank R alone`` (the launcher's rank) where none formed."""
    if dist.is_initialized():
        return f"rank {dist.get_rank()} of {dist.get_world_size()}"
    return f"rank {os.environ.get('RANK', '?')} alone"


def launch_rank():
    """This process's rank: the process group's, else the one the facade detects from the launcher's variables."""
    return dist.get_rank() if dist.is_initialized() else detect(os.environ).rank


def seed_regression_data(name):
    """``RegressionDataset(seed=None)`` (entropy) made reproducible for script ``name`` (module docstring)."""
    made = [0]
    unseeded = REAL_DATASET_INIT

    @functools.wraps(unseeded)
    def seeded(self, *args, seed=None, **kwargs):
        if seed is None and len(args) < 4:  # (a, b, length, seed): a seed given by position is kept too
            made[0] += 1
            seed = zlib.crc32(f"{name} {launch_rank()} {made[0]}".encode())
        unseeded(self, *args, seed=seed, **kwargs)

    RegressionDataset.__init__ = seeded


def run(name):
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch.manual_seed(FRESH_SEED)
    seed_regression_data(name)
    tally = Tally()
    faulthandler.dump_traceback_later(BUDGET, exit=True)
    start = time.perf_counter()
    try:
        load(name, tally).main()
    except BaseException as error:  # an assertion, or a SystemExit from a script
        say(f"own-scripts {name} {where()}: FAILED in {tally.running} after {len(tally.passed)} passed: "
            f"{type(error).__name__}: {error}".replace("\n", " "))
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    faulthandler.cancel_dump_traceback_later()
    seconds = time.perf_counter() - start
    say(f"own-scripts {name} {where()}: {len(tally.passed)} passed ({seconds:.1f} s): {' '.join(tally.passed)}")


def main(workdir, names):
    os.chdir(workdir)  # test_script.py writes a file in the current directory
    accelerates_own = unified_dist.accelerate.PartialState.__base__
    accelerates_own.destroy_process_group = lambda self, group=None: None
    for name in names:
        run(name)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
