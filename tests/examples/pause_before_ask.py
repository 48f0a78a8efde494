"""Run an example unchanged, paused once just before its N-th ``ud.should_stop()`` until this process has
received a stop signal, so that a test's signal lands at a known point of the loop on any machine:

    python tests/examples/pause_before_ask.py MARKER N SCRIPT [ARGS...]
    torchrun ... tests/examples/pause_before_ask.py MARKER N SCRIPT [ARGS...]

Before the N-th call each process writes ``MARKER.rank<RANK>`` (the test waits for it, then signals) and
polls until unified_dist has recorded a stop signal in this process; then the call goes on as usual. The
example is run as ``__main__`` with its own ``sys.argv``.
"""
import os
import runpy
import sys
import time

import unified_dist

marker, calls_before_pause, script, *rest = sys.argv[1:]
calls = [0]


def should_stop() -> bool:
    from unified_dist import facade, session

    calls[0] += 1
    if calls[0] == int(calls_before_pause):
        open(f"{marker}.rank{os.environ.get('RANK', '0')}", "w").close()
        while not session.current().stops.pending:  # the test's signal, recorded (or held) by unified_dist
            time.sleep(0.01)
    return facade.should_stop()


unified_dist.should_stop = should_stop
sys.argv = [script, *rest]
runpy.run_path(script, run_name="__main__")
