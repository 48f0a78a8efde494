"""``ud.shutdown()`` then ``ud.init()`` again, many times, in a job whose group the facade makes itself.

    <launcher> tests/launchers/workers/reinit_worker.py OUT_DIR [ROUNDS]

Each round: init, check the detected launcher and world, one all_reduce, shutdown. Rank R writes
OUT_DIR/reinit_rank<R>.json: the rounds completed and the launcher seen in each.
"""
import json
import os
import sys

import torch

import unified_dist as ud

out, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 12
seen = []
for _ in range(rounds):
    ud.init(timeout=30)
    total = ud.all_reduce(torch.tensor([ud.rank() + 1.0]), "sum").item()
    seen.append({"launcher": ud.launcher(), "world_size": ud.world_size(), "sum": total})
    rank = ud.rank()
    ud.shutdown()
with open(os.path.join(out, f"reinit_rank{rank}.json"), "w") as f:
    json.dump(seen, f)
