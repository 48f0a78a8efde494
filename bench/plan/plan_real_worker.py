"""A real rank against its plan: the tiny Llama of bench/plan/plan_llama.py (sequences of 64 tokens), one
AdamW step per layout, with the collectives of the step counted on the real process group by
``unified_dist.parallel.accounting.CollectiveCounter`` (a dispatch mode), from the first forward to the
end of the optimizer step: the window ``unified-dist plan`` counts.

    torchrun --standalone --nproc_per_node 4 bench/plan/plan_real_worker.py --layouts ddp,fsdp,hsdp,fsdp_tp --out DIR
    unified-dist plan --nproc 4 bench/plan/plan_real_worker.py --layouts fsdp --out DIR   # the plan of one layout

Each real rank writes DIR/rank<R>.json: {layout: {"collectives": [...], "bytes": {...}}}. Under the plan
the script is stopped right after the step, before it writes anything.
"""
import argparse
import json
import os
from pathlib import Path

import torch

import unified_dist as ud
from unified_dist.parallel.accounting import CollectiveCounter, group_labels, rank_bytes

LAYOUTS = {"ddp": {}, "fsdp": dict(sharding="fsdp"), "hsdp": dict(sharding="fsdp", dp_replicate=2),
           "fsdp_tp": dict(sharding="fsdp", tp=2, tp_plan="auto")}


def run(layout: str) -> dict:
    from plan_llama import SIZES
    from transformers import LlamaConfig, LlamaForCausalLM

    ud.init(**LAYOUTS[layout])
    try:
        torch.manual_seed(0)
        config = LlamaConfig(**SIZES["tiny"])
        model = LlamaForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        model, optimizer = ud.prepare(model, optimizer)
        ids = torch.randint(0, config.vocab_size, (2, 64))
        counter = CollectiveCounter()
        with counter:
            loss = model(input_ids=ids, labels=ids).loss
            ud.backward(loss)
            optimizer.step()
        labels = group_labels(ud.device_mesh())
        table = [{**row, "group": labels.get(row["group"], row["group"])} for row in counter.table()]
        inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        return {"collectives": table, "bytes": rank_bytes(ud.unwrap(model), inner)}
    finally:
        ud.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {layout: run(layout) for layout in args.layouts.split(",")}
    Path(args.out, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
