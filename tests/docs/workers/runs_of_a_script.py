"""Several runs of one script in the same processes, one after the other (tests/docs/test_readme.py): the runs share
the launcher's start and the imports, which on 2 cores cost more than the README snippet's own training.

    torchrun --standalone --nproc_per_node 2 tests/docs/workers/runs_of_a_script.py SCRIPT PLAN.json

PLAN.json is a list of ``{"name": ..., "args": [...], "cwd": FOLDER}``. For each run, every process changes to
``cwd``, rank 0 prints ``MARKER + name`` on its standard output, and the script runs as ``__main__`` with
``sys.argv = [SCRIPT, *args]``; then ``ud.shutdown()`` ends the run's session (the script's ``ud.init`` starts
the next one). What rank 0 prints after a marker and before the next is that run's: the marker and its split
(``split_output``) are tests/examples/runs_in_one_launch.py's, which does the same for the example's ``main()``.
The launch fails with the first run that does.
"""
import json
import os
import runpy
import sys
from pathlib import Path

import unified_dist as ud

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from runs_in_one_launch import MARKER  # noqa: E402  (the example's runs in one launch: the same marker)


def main() -> None:
    script, plan = os.path.abspath(sys.argv[1]), json.loads(open(sys.argv[2]).read())
    for entry in plan:
        os.chdir(entry["cwd"])
        if os.environ.get("RANK", "0") == "0":
            print(f"{MARKER}{entry['name']}", flush=True)
        sys.argv = [script, *entry["args"]]
        runpy.run_path(script, run_name="__main__")
        ud.shutdown()


if __name__ == "__main__":
    main()
