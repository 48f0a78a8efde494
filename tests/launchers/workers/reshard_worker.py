"""Sharded and full checkpoints moved between device-mesh layouts, optimizer state included, while
one training run goes on across them.

    torchrun --standalone --nproc_per_node 4 tests/launchers/workers/reshard_worker.py --out DIR \
        --chain hsdp,fsdp4,fsdp_tp,tp4
    torchrun --standalone --nproc_per_node 2 tests/launchers/workers/reshard_worker.py --out DIR --chain fsdp2

(the first and the last leg, one process without sharding, run inside the test itself: ``leg("plain", ...)``).

Each layout of ``--chain`` is one ``ud.init(...)`` .. ``ud.shutdown()`` in the same processes. A leg
of layout L: build MeshNet and AdamW, ``ud.prepare``, ``ud.load_sharded`` the newest checkpoint in
DIR (the previous leg's, any layout), train STEPS_PER_LEG optimizer steps on the next global
batches (each data-parallel rank its slice), then write three files beside each other:

- ``NN_L_sharded/``: ``ud.save_sharded({"model", "optimizer", "step"})``;
- ``NN_L_full.pt``: ``ud.save({"model", "optimizer", "step"})``, the full state;
- ``NN_L_witness.pt``: the full weights and AdamW state by parameter name, gathered here with
  torch's own ``DTensor.full_tensor()`` and written with ``torch.save`` on rank 0 (the test compares
  it with one plain process, and the loads below with it, bitwise).

Before training, after the save, and at the end of a launch again in every layout of its chain, every
checkpoint in DIR not yet loaded into L is loaded, sharded and full, into a fresh prepared model and
optimizer: its weights and AdamW state (step, exp_avg, exp_avg_sq) must equal its witness bitwise, each
moment laid out as its parameter. A checkpoint moves between layouts without a change.

Every rank runs every check in the same order and asserts only afterwards, so a failing rank does not
hang the others. Results: DIR/reshard_<chain>_rank<R>.json as {check: "ok" | "FAIL: ..."}. Expected
values come from the witness (torch) and from plain single-process torch, never from the facade.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time
import traceback

import torch

import unified_dist as ud

sys.path.insert(0, os.path.dirname(__file__))
from mesh_worker import PLAN, MeshNet  # noqa: E402

LAYOUTS = {  # name -> (init keywords, (dp_replicate, dp_shard, tp), w1's placements)
    "plain": ({}, (1, 1, 1), None),
    "hsdp": (dict(sharding="fsdp", dp_replicate=2), (2, 2, 1), ["Replicate", "Shard"]),
    "fsdp4": (dict(sharding="fsdp"), (1, 4, 1), ["Shard"]),
    "fsdp_tp": (dict(sharding="fsdp", tp=2), (1, 2, 2), ["_StridedShard", "Shard"]),
    "tp4": (dict(tp=4), (1, 1, 4), ["Shard"]),
    "fsdp2": (dict(sharding="fsdp"), (1, 2, 1), ["Shard"]),
}
GLOBAL_BATCH = 8  # samples per optimizer step, split evenly over the data-parallel ranks (1, 2 or 4)
STEPS_PER_LEG = 2
LEGS = ("plain", "hsdp", "fsdp4", "fsdp_tp", "tp4", "fsdp2", "plain")
TOTAL_STEPS = STEPS_PER_LEG * len(LEGS)
LR = 0.01
WEIGHT_DECAY = 0.1


def data():
    g = torch.Generator().manual_seed(123)
    n = GLOBAL_BATCH * TOTAL_STEPS
    return torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)


def new_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def reference(steps, dtype=torch.float32):
    """One plain process, no unified_dist: ``steps`` AdamW steps in ``dtype``, each on the mean squared error of
    the next global batch. Returns {"model": {name: tensor}, "optim": {name: {state}}, "step": steps}."""
    x, y = (t.to(dtype) for t in data())
    model = MeshNet().to(dtype)
    opt = new_optimizer(model)
    for s in range(steps):
        batch = slice(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH)
        torch.nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
        opt.step()
        opt.zero_grad()
    return {"model": {k: v.detach().clone() for k, v in model.named_parameters()},
            "optim": {k: {n: t.clone() for n, t in opt.state[p].items()} for k, p in model.named_parameters()},
            "step": steps}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _inner(optimizer):
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def gathered(model, optimizer):
    """Weights and AdamW state by parameter name, full tensors (torch's own gather; a collective)."""
    inner, opt = ud.unwrap(model), _inner(optimizer)
    named = list(inner.named_parameters())
    return {"model": {k: _full(p.detach()).cpu().clone() for k, p in named},
            "optim": {k: {n: _full(t).cpu().clone() for n, t in sorted(opt.state[p].items())} for k, p in named}}


def checkpoints(out):
    """The checkpoints in ``out`` in the order they were written: (index, layout, prefix)."""
    found = []
    for path in glob.glob(os.path.join(out, "*_witness.pt")):
        index, layout = re.match(r"(\d+)_(\w+?)_witness\.pt$", os.path.basename(path)).groups()
        found.append((int(index), layout, path[:-len("_witness.pt")]))
    return sorted(found)


def prepared():
    model = MeshNet()
    model, optimizer = ud.prepare(model, new_optimizer(model))
    return model, optimizer


def same(got, want, what):
    """Bitwise equality of two {"model": ..., "optim": ...} dicts."""
    assert sorted(got["model"]) == sorted(want["model"]), (what, sorted(got["model"]))
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), f"{what}: weight {k} differs by {(got['model'][k] - v).abs().max():.2e}"
    for k, state in want["optim"].items():
        assert sorted(got["optim"][k]) == sorted(state), (what, k, sorted(got["optim"][k]), sorted(state))
        for n, v in state.items():
            assert torch.equal(got["optim"][k][n].to(v.dtype), v), \
                f"{what}: optimizer {n} of {k} differs by {(got['optim'][k][n].double() - v.double()).abs().max():.2e}"


def _load(kind, prefix, model, optimizer, holder):
    if kind == "sharded":
        holder["extra"] = ud.load_sharded({"model": model, "optimizer": optimizer}, f"{prefix}_sharded")
    else:
        holder["extra"] = ud.load(f"{prefix}_full.pt", {"model": model, "optimizer": optimizer})


def _equals_witness(got, holder, prefix, name):
    witness = torch.load(f"{prefix}_witness.pt", weights_only=True)
    assert holder["extra"] == {"step": witness["step"]}, (holder["extra"], witness["step"])
    same(got, witness, name)


def _laid_out_like(model, optimizer):
    """Each AdamW moment of a parameter is a tensor of its kind: for a DTensor the same mesh, placements
    and local shape (AdamW's next step adds them elementwise), for a plain tensor a plain one."""
    from torch.distributed.tensor import DTensor

    opt = _inner(optimizer)
    for k, p in ud.unwrap(model).named_parameters():
        for n in ("exp_avg", "exp_avg_sq"):
            t = opt.state[p][n]
            assert isinstance(t, DTensor) == isinstance(p, DTensor), (k, n, type(t).__name__, type(p).__name__)
            if isinstance(p, DTensor):
                assert (t.device_mesh, t.placements) == (p.device_mesh, p.placements), (k, n, t.placements)
                assert t.to_local().shape == p.to_local().shape, (k, n, t.to_local().shape, p.to_local().shape)
            assert t.shape == p.shape, (k, n, t.shape, p.shape)


class Leg:
    """One layout's session: its checks go into ``results`` under ``<layout>/<name>``."""

    def __init__(self, layout, results, verified):
        self.layout, self.results, self.verified = layout, results, verified
        keywords, self.expect, self.placements = LAYOUTS[layout]
        tp = self.expect[2]
        ud.init(**keywords, **({"tp_plan": PLAN} if tp > 1 else {}))

    def attempt(self, check, fn, *args):
        try:
            fn(*args)
            self.results[f"{self.layout}/{check}"] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported per check
            trace = traceback.format_exc()[-1500:]
            self.results[f"{self.layout}/{check}"] = f"FAIL: {type(exc).__name__}: {exc}\n{trace}"

    def identity(self):
        R, S, T = self.expect
        assert ud.world_size() == R * S * T, (ud.world_size(), self.expect)
        assert ud.data_parallel_world_size() == R * S, (ud.data_parallel_world_size(), self.expect)
        if R * S * T > 1:
            mesh = ud.device_mesh()
            assert tuple(mesh.shape) == (R, S, T), (tuple(mesh.shape), self.expect)

    def verify(self, out):
        """Load every checkpoint in ``out`` not yet loaded into this layout, both kinds; each must equal
        its witness bitwise (and say which step it holds)."""
        for index, source, prefix in checkpoints(out):
            for kind in ("sharded", "full"):
                name = f"{index:02d}_{source}_{kind}"
                if (self.layout, name) in self.verified:
                    continue
                self.verified.add((self.layout, name))
                model, optimizer = prepared()
                holder = {}
                self.attempt(f"loads/{name}", _load, kind, prefix, model, optimizer, holder)
                self.attempt(f"optimizer_state_is_laid_out_like_its_parameter/{name}", _laid_out_like, model, optimizer)
                got = gathered(model, optimizer)  # every rank, whatever the load did
                self.attempt(f"equals_witness/{name}", _equals_witness, got, holder, prefix, name)

    def train(self, out, index):
        """Resume from the newest checkpoint (if any), STEPS_PER_LEG steps, write the three files."""
        model, optimizer = prepared()
        found = checkpoints(out)
        resumed = {"step": 0}

        def resume():
            resumed.update(ud.load_sharded({"model": model, "optimizer": optimizer}, f"{found[-1][2]}_sharded"))
        if found:  # a failed load trains on from step 0: the test sees the failure and the wrong step
            self.attempt("resumes_from_the_previous_legs_sharded_checkpoint", resume)
        start = resumed["step"]

        def placements():
            if self.placements is not None:
                w1 = ud.unwrap(model).blocks[0].w1.weight
                assert [type(p).__name__ for p in w1.placements] == self.placements, w1.placements
        self.attempt("parameters_are_laid_out_on_the_mesh", placements)
        x, y = data()
        per = GLOBAL_BATCH // ud.data_parallel_world_size()
        d = ud.data_parallel_rank()
        for s in range(start, start + STEPS_PER_LEG):
            lo = s * GLOBAL_BATCH + d * per
            ud.backward(torch.nn.functional.mse_loss(model(x[lo:lo + per]), y[lo:lo + per]))
            optimizer.step()
            optimizer.zero_grad()
        step = start + STEPS_PER_LEG
        prefix = os.path.join(out, f"{index:02d}_{self.layout}")
        ud.save_sharded({"model": model, "optimizer": optimizer, "step": step}, f"{prefix}_sharded")
        ud.save({"model": model, "optimizer": optimizer, "step": step}, f"{prefix}_full.pt")
        witness = {**gathered(model, optimizer), "step": step}
        if ud.rank() == 0:
            torch.save(witness, f"{prefix}_witness.pt")
        ud.barrier()
        return step


# The pipeline legs (issue 61, item 5): a second run of the same MeshNet, in float64, whose checkpoints are
# ud.save's one file ({"model", "optimizer", "step"}; the per-rank formats are refused under pp), in DIR/pp:
#     this process (1) -> x 2: pp 2 -> x 4: pp 2 x FSDP 2 -> TP 4 -> this process (1)
# each leg in the launch of its world size, after that launch's float32 legs (a fresh ud.init).
PP_LAYOUTS = {  # name -> (init keywords, pipeline stages, data-parallel ranks)
    "plain": ({}, 1, 1),
    "pp2": (dict(pp=2, pp_microbatches=2), 2, 1),
    "pp2_fsdp2": (dict(pp=2, sharding="fsdp", pp_microbatches=2), 2, 2),
    "tp4": (dict(tp=4, tp_plan=PLAN), 1, 1),
}
PP_CHAIN = ("plain", "pp2", "pp2_fsdp2", "tp4", "plain")
PP_DTYPE = torch.float64


def pp_checkpoints(out):
    """The pipeline chain's checkpoints in ``out`` in the order written: [(index, layout, path)]."""
    found = [re.match(r"(\d+)_(\w+)\.pt$", os.path.basename(path)) for path in glob.glob(os.path.join(out, "*.pt"))]
    return sorted((int(m.group(1)), m.group(2), os.path.join(out, m.group(0))) for m in found if m)


def pp_leg(layout, out, results):
    """Leg ``len(pp_checkpoints(out))`` of the pipeline chain: ``ud.load`` the previous leg's file (model and
    AdamW state) into a fresh prepared float64 MeshNet of this layout, STEPS_PER_LEG steps on the next global
    batches (``ud.pipeline_step`` under pp, each data-parallel rank its slice), ``ud.save`` to ``NN_<layout>.pt``.
    Checks go into ``results`` as ``pp/<layout>/<check>``."""
    keywords, stages, dp = PP_LAYOUTS[layout]
    found = pp_checkpoints(out)
    index = len(found)
    ud.init(**keywords)
    try:
        def attempt(check, fn):
            try:
                fn()
                results[f"pp/{layout}/{check}"] = "ok"
            except Exception as exc:  # noqa: BLE001 - reported per check
                results[f"pp/{layout}/{check}"] = f"FAIL: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"

        def identity():
            assert (ud.pipeline_stages(), ud.data_parallel_world_size()) == (stages, dp), \
                (ud.pipeline_stages(), ud.data_parallel_world_size(), layout)
        attempt("identity", identity)
        model = MeshNet().to(PP_DTYPE)
        model, optimizer = ud.prepare(model, new_optimizer(model))
        resumed = {"step": 0}
        if found:  # a failed load trains on from step 0: the test sees the failure and the wrong step
            attempt("resumes_from_the_previous_legs_checkpoint",
                    lambda: resumed.update(ud.load(found[-1][2], {"model": model, "optimizer": optimizer})))
        x, y = (t.to(PP_DTYPE) for t in data())
        per = GLOBAL_BATCH // dp
        d = ud.data_parallel_rank()
        loss = torch.nn.functional.mse_loss
        for s in range(resumed["step"], resumed["step"] + STEPS_PER_LEG):
            lo = s * GLOBAL_BATCH + d * per
            if stages > 1:
                ud.pipeline_step(model, x[lo:lo + per], y[lo:lo + per], loss)
            else:
                ud.backward(loss(model(x[lo:lo + per]), y[lo:lo + per]))
            optimizer.step()
            optimizer.zero_grad()
        step = resumed["step"] + STEPS_PER_LEG
        ud.save({"model": model, "optimizer": optimizer, "step": step}, os.path.join(out, f"{index:02d}_{layout}.pt"))
        ud.barrier()
    finally:
        ud.shutdown()


def leg(layout, out, results, verified, index=None, train=True):
    """One layout: verify what is there, then (``train``) continue the run and write checkpoint ``index``."""
    session = Leg(layout, results, verified)
    try:
        session.attempt("identity", session.identity)
        session.verify(out)
        if not train:
            return None
        step = session.train(out, index)
        session.verify(out)  # its own checkpoint, loaded back into the layout that wrote it
        return step
    finally:
        ud.shutdown()


def main():
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("RESHARD_DUMP_AFTER", "500")), exit=True)
    parser = argparse.ArgumentParser()
    parser.add_argument("--chain", default="", help="layouts, in order, e.g. hsdp,fsdp4,fsdp_tp,tp4")
    parser.add_argument("--out", required=True)
    parser.add_argument("--pp-chain", default="", help="then the pipeline chain's legs, in order, e.g. pp2_fsdp2,tp4")
    args = parser.parse_args()
    chain = [layout for layout in args.chain.split(",") if layout]
    results, verified = {}, set()
    for layout in chain:
        leg(layout, args.out, results, verified, index=len(checkpoints(args.out)))
    for layout in chain[:-1]:  # the checkpoints written after a layout's leg, loaded into it too
        leg(layout, args.out, results, verified, train=False)
    rank = int(os.environ["RANK"])
    if chain:
        with open(os.path.join(args.out, f"reshard_{'_'.join(chain)}_rank{rank}.json"), "w") as f:
            json.dump(results, f, indent=1)
    if args.pp_chain:  # in the same processes, after the float32 legs (a fresh ud.init each)
        pp_results, started = {}, time.perf_counter()
        for layout in args.pp_chain.split(","):
            pp_leg(layout, os.path.join(args.out, "pp"), pp_results)
        if rank == 0:  # what these legs add to the launch (the test prints it)
            print(f"pipeline legs {args.pp_chain}: {time.perf_counter() - started:.1f} s", flush=True)
        with open(os.path.join(args.out, "pp", f"reshard_{args.pp_chain.replace(',', '_')}_rank{rank}.json"), "w") as f:
            json.dump(pp_results, f, indent=1)


if __name__ == "__main__":
    main()
