"""Facade and native training steps alternating in one launch: the step-time ratio without launch noise.

    <launcher> bench/step/paired.py --out FILE [--steps N] [--warmup W]

Two identical copies of the example's model train side by side in the same processes: one
prepared by unified_dist, one wrapped by hand with the backend's own library (the
``native_<backend>.py`` code). Steps alternate facade/native, swapping which goes first every
pair, so machine noise (other load, frequency, cache state) hits both alike; separate launches
differ by several percent from one launch to the next on this machine.
"""
import copy
import importlib
import json
import statistics
import time

import torch

import facade
import unified_dist as ud
from common import model_and_batches, parse_args

args = parse_args()
ud.init()
native = importlib.import_module(f"native_{ud.backend_name()}")
rank, world = native.init()  # joins the group unified_dist already joined
model, batches = model_and_batches(args, rank, world)
twin = copy.deepcopy(model)
steps = {"facade": facade.make_step(model), "native": native.make_step(twin)}
times = {"facade": [], "native": []}
for i, batch in enumerate(batches):
    order = ("facade", "native") if i % 2 == 0 else ("native", "facade")
    for name in order:
        ud.barrier()
        start = time.perf_counter()
        steps[name](batch)
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            times[name].append(ud.all_reduce(torch.tensor([elapsed]), "max").item())
ratios = [f / n for f, n in zip(times["facade"], times["native"])]
if ud.is_main():
    with open(args.out, "w") as f:
        json.dump({"backend": ud.backend_name(), "world_size": world, "step_times_s": times,
                   "median_step_s": {k: statistics.median(v) for k, v in times.items()},
                   "ratio_of_medians": statistics.median(times["facade"]) / statistics.median(times["native"]),
                   "median_paired_ratio": statistics.median(ratios), "paired_ratios": ratios}, f, indent=1)
ud.shutdown()
