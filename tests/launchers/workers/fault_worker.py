"""Fault scenarios run under a real launcher; each rank records the error it saw.

    <launcher> tests/launchers/workers/fault_worker.py SCENARIO[,SCENARIO...] OUT_DIR

Several check-mode scenarios (``mismatch_*``) run one after another in the same processes: each records
``SCENARIO_rankR.json``; the error of every scenario but the last is recorded and the next one starts on the same
group (check mode raises before the mismatched collective runs, on every rank); the last one's error ends the job
as a user's uncaught error would. A single scenario writes ``rankR.json``.
"""
import json
import os
import signal
import sys
import time

import torch

import unified_dist as ud


def record(out, prefix="", **data):
    with open(os.path.join(out, f"{prefix}rank{ud.rank()}.json"), "w") as f:
        json.dump(data, f)


def is_horovods_internal_error(exc):
    """Under horovodrun: whether ``exc`` is an instance of Horovod's own ``HorovodInternalError`` (the class
    ``hvd.elastic.run`` catches), not of a look-alike of that name; ``None`` elsewhere."""
    if not os.environ.get("HOROVOD_RANK"):
        return None
    from horovod.common.exceptions import HorovodInternalError

    return isinstance(exc, HorovodInternalError)


def waits_after_a_timeout():
    """Issue 46: what ud.barrier() and ud.shutdown() (whose barrier waits for every rank) raise while rank 1
    still sleeps: 'Type: message up to its first colon' each, or 'ok'."""
    said = []
    # not Horovod's shutdown: it waits in its own gloo store and aborts the process (gloo::IoException, exit 134)
    for wait in (ud.barrier,) if ud.backend_name() == "horovod" else (ud.barrier, ud.shutdown):
        try:
            wait()
            said.append("ok")
        except Exception as exc:  # noqa: BLE001 - reported, asserted by the test
            said.append(f"{type(exc).__name__}: {str(exc).split(':')[0]}")
    return said


def main():
    scenarios, out = sys.argv[1].split(","), sys.argv[2]
    checking = scenarios[0].startswith("mismatch")
    if len(scenarios) > 1 and not all(scenario.startswith("mismatch") for scenario in scenarios):
        raise SystemExit(f"fault_worker.py: only check-mode scenarios run in one launch, got {scenarios}")
    ud.init(debug=checking, timeout=4 if scenarios[0] == "timeout" else 60)
    for n, scenario in enumerate(scenarios):
        last = n == len(scenarios) - 1
        run(scenario, out, prefix="" if len(scenarios) == 1 else f"{scenario}_", uncaught=last)


def run(scenario, out, prefix, uncaught):
    r = ud.rank()
    ud.barrier()
    start = time.monotonic()
    try:
        if scenario == "mismatch_shape":
            ud.all_reduce(torch.ones(3 + r), "sum")
        elif scenario == "mismatch_op":
            ud.all_gather(torch.ones(2)) if r == 0 else ud.barrier()
        elif scenario == "mismatch_ok":  # dim 0 may differ for all_gather: no false alarm
            ud.all_gather(torch.ones(1 + r, 2))
        elif scenario == "timeout":
            if r == 1:
                time.sleep(60)
            ud.all_reduce(torch.ones(3), "sum")
        elif scenario == "rank_dies":
            if r == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            # the launcher stops the survivors with SIGTERM when a rank dies; ignoring it lets rank 0
            # show what its own collective does when the peer is gone (the launcher's SIGKILL follows)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            for _ in range(1000):
                ud.all_reduce(torch.ones(3), "sum")
                time.sleep(0.01)
        elif scenario == "nan_loss":
            model = torch.nn.Linear(2, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model, opt = ud.prepare(model, opt)
            for step in range(1, 6):
                loss = model(torch.ones(4, 2)).mean()
                if step == 3 and r == ud.world_size() - 1:
                    loss = loss * float("nan")
                ud.backward(loss)
                opt.step()
                opt.zero_grad()
        else:
            raise SystemExit(f"fault_worker.py: no scenario {scenario!r}")
    except ud.UnifiedDistError as exc:
        elapsed = time.monotonic() - start
        record(out, prefix, error=type(exc).__name__, message=str(exc), elapsed=elapsed,
               horovod_internal_error=is_horovods_internal_error(exc),
               then=waits_after_a_timeout() if scenario == "timeout" else None)
        if uncaught:
            raise SystemExit(3) from exc
        return
    record(out, prefix, error=None, message="", elapsed=time.monotonic() - start)


if __name__ == "__main__":
    main()
