"""One rank of bench/deepspeed/deepspeed_bench.py: the same model and AdamW through FSDP2 and through DeepSpeed's
engine at ZeRO stages 0-3, one ``ud.init(...)`` .. ``ud.shutdown()`` session after another in one launch.

    torchrun --standalone --nproc_per_node 2 bench/deepspeed/deepspeed_worker.py --repeats 3 --steps 3 --out DIR

Per repeat, the timed layouts (``fsdp``, ``zero2``, ``zero3``) run in an order rotated by the repeat (so no layout
always runs first), each a warm-up step then ``--steps`` timed steps; the first repeat also runs ``zero0`` and
``zero1`` for their bytes. Per layout and rank (DIR/rank<R>.json): the wall time of each step, and after the last
step the bytes this rank holds, each storage once (:func:`held_bytes`):

- ``params``: the module's parameters as this rank stores them (FSDP2: a DTensor's local shard; ZeRO-3: DeepSpeed's
  partition ``ds_tensor``, the parameter itself being an empty placeholder; otherwise the whole parameter);
- ``master``: the tensors the optimizer steps that are not the module's parameters (ZeRO 1-3: DeepSpeed's float32
  partitions, a copy beside the module's weights; FSDP2 and stage 0 step the module's parameters: 0);
- ``optimizer``: every tensor in the optimizer's state (AdamW's exp_avg, exp_avg_sq, step).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "memory_layouts"))

from memory_layouts_worker import build  # noqa: E402  (the example's MiniLM-L6 BERT, its AdamW, seeded batches)

from unified_dist.parallel.accounting import tensor_bytes  # noqa: E402

LAYOUTS = {"fsdp": dict(sharding="fsdp"), "zero0": dict(backend="deepspeed", zero_stage=0),
           "zero1": dict(backend="deepspeed", zero_stage=1), "zero2": dict(backend="deepspeed", zero_stage=2),
           "zero3": dict(backend="deepspeed", zero_stage=3)}
TIMED = ("fsdp", "zero2", "zero3")
MEMORY_ONLY = ("zero0", "zero1")


def held_parameter(p: torch.Tensor) -> torch.Tensor:
    """What this rank stores of parameter ``p``: DeepSpeed ZeRO-3's partition, a DTensor's shard, else ``p``."""
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor
    return p.to_local() if hasattr(p, "to_local") else p


def held_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's bytes of the module's parameters, of the optimizer's own weights where they are other tensors
    (master copies), and of the optimizer's state; a storage counted once (:func:`tensor_bytes`)."""
    params = [held_parameter(p) for p in module.parameters()]
    stepped = [held_parameter(p) for group in optimizer.param_groups for p in group["params"]]
    state = [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    out = {"params": tensor_bytes(params), "master": tensor_bytes(params + stepped) - tensor_bytes(params),
           "optimizer": tensor_bytes(state)}
    out["total"] = out["params"] + out["master"] + out["optimizer"]
    return out


def run_layout(name: str, steps: int) -> dict:
    import unified_dist as ud

    model, optimizer, _, batch = build("bert")
    ud.init(**LAYOUTS[name])
    try:
        model, optimizer = ud.prepare(model, optimizer)
        inputs = batch(1000 + ud.rank())
        times = []
        for _ in range(steps + 1):  # the first: warm-up
            ud.barrier()
            start = time.perf_counter()
            loss = model(**inputs).loss
            ud.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
            del loss
        return {"backend": ud.backend_name(), "stage": ud.zero_stage(), "world": ud.world_size(),
                "bytes": held_bytes(ud.unwrap(model), optimizer),
                "elements": sum(getattr(p, "ds_numel", p.numel()) for p in ud.unwrap(model).parameters()),
                "step_s": times[1:], "warmup_s": times[0]}
    finally:
        ud.shutdown()
        del model, optimizer
        gc.collect()


def main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("DEEPSPEED_BENCH_DUMP_AFTER", "1500")), exit=True)
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {"repeats": []}
    for repeat in range(args.repeats):
        order = TIMED[repeat % len(TIMED):] + TIMED[:repeat % len(TIMED)]
        report["repeats"].append({name: run_layout(name, args.steps) for name in order})
    report["memory_only"] = {name: run_layout(name, 1) for name in MEMORY_ONLY}
    rank = int(os.environ.get("RANK", "0"))
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
