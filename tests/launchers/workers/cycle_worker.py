"""Horovod's cycle, measured in a launch where the user chose one (the facade must keep it):

    HOROVOD_CYCLE_TIME=50 horovodrun -np 2 -H localhost:2 --gloo python tests/launchers/workers/cycle_worker.py OUT_DIR

Each rank writes OUT_DIR/cycle_rank<R>.json: the ``HOROVOD_CYCLE_TIME`` it runs with and the times
of scalar all-reduces, measured as the contract worker's accumulation suite measures the default launch.
"""
import json
import os
import sys

from contract_worker import scalar_all_reduce_ms

import unified_dist as ud


def main():
    out = sys.argv[1]
    ud.init()
    record = {"HOROVOD_CYCLE_TIME": os.environ.get("HOROVOD_CYCLE_TIME"),
              "scalar_all_reduce": scalar_all_reduce_ms()}
    with open(os.path.join(out, f"cycle_rank{ud.rank()}.json"), "w") as f:
        json.dump(record, f)
    ud.shutdown()


if __name__ == "__main__":
    main()
