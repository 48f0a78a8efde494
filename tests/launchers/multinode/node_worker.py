"""tests/launchers/workers/contract_worker.py, plus a record of where each rank ran.

    <launcher> tests/launchers/multinode/node_worker.py --suite core|accum --out DIR

Writes DIR/where_<suite>_rank<R>.json (host name, network interfaces, the launcher's interface
variables), then runs the contract checks exactly as contract_worker.py does (DIR/<suite>_rank<R>.json).
The rank is read from the launcher's variables (RANK: torchrun/accelerate; HOROVOD_RANK: horovodrun)
so that recording it touches nothing the checks measure.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "workers"))

import contract_worker  # noqa: E402


def where() -> dict:
    try:
        interfaces = sorted(os.listdir("/sys/class/net"))  # ip netns exec mounts the namespace's /sys
    except OSError:
        interfaces = []
    return {"hostname": socket.gethostname(), "interfaces": interfaces, "pid": os.getpid(),
            **{k: os.environ.get(k) for k in ("RANK", "HOROVOD_RANK", "HOROVOD_HOSTNAME", "MASTER_ADDR",
                                              "GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE")}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", required=True)
    parser.add_argument("--out", required=True)
    args, _ = parser.parse_known_args()
    rank = os.environ.get("RANK") or os.environ.get("HOROVOD_RANK") or "0"
    with open(os.path.join(args.out, f"where_{args.suite}_rank{rank}.json"), "w") as f:
        json.dump(where(), f)
    contract_worker.main()


if __name__ == "__main__":
    main()
