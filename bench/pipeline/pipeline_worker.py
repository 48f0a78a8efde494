"""One launch of bench/pipeline/pipeline_bench.py (``torchrun --nproc_per_node 2``): the step time of
GPipe and 1F1B at several microbatch counts, each stage's busy time, and the unpipelined step, all in
the same processes (ratios within one run).

    torchrun --standalone --nproc_per_node 2 bench/pipeline/pipeline_worker.py --out FILE [--steps 5]

The model: an input layer, BLOCKS residual MLP blocks of width WIDTH (hidden 4 x WIDTH), a head; a global
batch of ROWS rows, float32, SGD. Per configuration ``ud.init(pp=2, pp_schedule=..., pp_microbatches=M)``
.. ``ud.shutdown()``: after a warm-up step, ``--steps`` steps of ``ud.pipeline_step`` + ``optimizer.step()``,
each between two barriers, timed on every rank (a step's time: the slowest rank's). Then each rank runs
its stage alone, M microbatches' forward and backward with no communication (its *busy* time per step):
the rest of the step it waits for the other stage or for a message, the measured bubble fraction
``1 - busy / step``. One more step, untimed, counts the bytes of activations autograd holds for backward on each
rank (:class:`ActivationBytes`): their peak during the step, and what is left after it (0: every graph freed).
The unpipelined step: rank 0 alone runs the whole model on the whole batch (plain
torch, the step one process takes), while rank 1 waits at a barrier.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import unified_dist as ud

WIDTH, BLOCKS, ROWS = 384, 8, 64
SCHEDULES = ("gpipe", "1f1b")
MICROBATCHES = (2, 4, 8)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(WIDTH, WIDTH)
        self.layers = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = torch.nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output, target)


def batch():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, WIDTH, generator=generator), torch.randint(0, 10, (ROWS,), generator=generator)


def timed(fn, steps: int) -> list:
    """``fn()`` ``steps`` times after one warm-up, each between barriers; the slowest rank's seconds each."""
    fn()
    out = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        out.append(float(took))
    return out


def unpipelined(steps: int) -> list:
    ud.init()
    try:
        torch.manual_seed(0)
        model = Stack()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = batch()

        def step():
            if dist.get_rank() == 0:  # one process, the whole model and batch; rank 1 waits
                loss_fn(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
        return timed(step, steps)
    finally:
        ud.shutdown()


class ActivationBytes:
    """Bytes of activations autograd holds for backward, alive now and at the peak: every tensor a forward saves
    (``torch.autograd.graph.saved_tensors_hooks``) counts from its save until its graph is freed by that
    microbatch's backward; tensors that share a parameter's storage (a weight, or its transpose) are not
    activations and do not count. Each save counts, a tensor two operations save twice (the library's
    ``unified_dist.parallel.accounting.SavedBytes``, which ``unified-dist plan`` uses, counts a storage once): for
    this MLP, whose operations save distinct tensors, the two agree."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.alive = self.peak = 0
        self._weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(self, tensor: torch.Tensor) -> "_Held":
        size = 0 if tensor.untyped_storage().data_ptr() in self._weights else tensor.numel() * tensor.element_size()
        self.alive += size
        self.peak = max(self.peak, self.alive)
        return _Held(tensor, size, self)

    @staticmethod
    def unpack(held: "_Held") -> torch.Tensor:
        return held.tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    """One saved tensor; its bytes leave the count when autograd drops it (the graph freed after backward)."""

    __slots__ = ("tensor", "size", "owner")

    def __init__(self, tensor: torch.Tensor, size: int, owner: ActivationBytes) -> None:
        self.tensor, self.size, self.owner = tensor, size, owner

    def __del__(self) -> None:
        self.owner.alive -= self.size


def pipelined(schedule: str, microbatches: int, steps: int) -> dict:
    ud.init(pp=2, pp_schedule=schedule, pp_microbatches=microbatches)
    try:
        torch.manual_seed(0)
        model = Stack()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        model, optimizer = ud.prepare(model, optimizer)
        x, y = batch()

        def step():
            ud.pipeline_step(model, x, y, loss_fn)
            optimizer.step()
            optimizer.zero_grad()
        step_s = timed(step, steps)
        saved = ActivationBytes(model)
        with saved.hooks():  # one more step, untimed: the activations this stage holds at its peak
            step()
        stage = ud.unwrap(model)  # this rank's stage alone: the other stage's units pass their input through
        held = sum(p.numel() * p.element_size() for p in stage.parameters())
        rows = ROWS // microbatches
        piece = torch.randn(rows, WIDTH)

        def busy():
            for _ in range(microbatches):
                out = stage(piece)
                out.float().pow(2).mean().backward()
            optimizer.zero_grad()
        busy()  # warm-up
        busy_s = []
        for _ in range(steps):
            start = time.perf_counter()
            busy()
            busy_s.append(time.perf_counter() - start)
        mine = torch.tensor([statistics.median(busy_s), held, saved.peak, saved.alive], dtype=torch.float64)
        every = [torch.zeros(4, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return {"schedule": schedule, "microbatches": microbatches, "step_s": step_s,
                "busy_s_per_rank": [float(t[0]) for t in every],
                "parameter_bytes_per_rank": [int(t[1]) for t in every],
                "activation_peak_bytes_per_rank": [int(t[2]) for t in every],
                "activation_bytes_after_step_per_rank": [int(t[3]) for t in every]}
    finally:
        ud.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [pipelined(schedule, m, args.steps) for m in MICROBATCHES for schedule in SCHEDULES]
    plain = unpipelined(args.steps)
    record = {"model": {"width": WIDTH, "blocks": BLOCKS, "rows": ROWS,
                        "parameters": sum(p.numel() for p in Stack().parameters())},
              "unpipelined_step_s": plain, "pipelined": rows}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
