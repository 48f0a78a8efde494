"""Pipeline parallelism (issue 61) checked inside every rank of one real launch.

    torchrun --standalone --nproc_per_node=2 tests/launchers/workers/pipeline_worker.py --cases pp_gpipe_sgd,...
    torchrun --standalone --nproc_per_node=4 tests/launchers/workers/pipeline_worker.py --cases pp_fsdp_sgd,...

Each case is one ``ud.init(pp=2, ...)`` .. ``ud.shutdown()`` in the same processes: a stack (embedding
layer, 4 blocks, head) in float64 trains STEPS steps with ``ud.pipeline_step`` on a prepared loader, and
every rank compares its stage's parameters with one plain process (plain torch, no facade) that took the
same steps on the global batches (the union of the data-parallel ranks' batches, whatever their order:
a mean gradient does not depend on it). Every check runs on every rank in the same order and is only
asserted afterwards, so a failing rank does not hang the others. Each rank prints one JSON line per case,
``{"case": ..., "rank": ..., "stage": ..., "checks": {name: "ok" | "FAIL: ..."}, "max_diff": ...}``,
each written whole in one write(2) so that two ranks' lines never interleave.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import traceback

import torch
import torch.distributed as dist

import unified_dist as ud

DTYPE = torch.float64
STEPS = 3
ROWS = 32  # the dataset
PER_RANK = 4  # rows per data-parallel rank and step
LR = 0.05
OUT = "."  # --out
BOUND = 1e-12
"""Float64 throughout: the pipeline sums each gradient in another order than one process (per microbatch,
then the schedule's division by the microbatches, then FSDP's average over the data-parallel ranks), and
each sum of n <= 32 terms (rows, widths 8) of magnitude O(1) moves by at most n * 2**-53 ~ 4e-15 of it.
SGD moves a parameter by lr * that ~ 2e-16 per step. AdamW's first steps divide by sqrt(v) + eps with
sqrt(v) ~ |g| (not tiny here: the data are O(1)), so the step moves by ~ lr * dg / |g| ~ lr * 1e-15: three
steps stay below 1e-12 with two orders of magnitude to spare (the measured difference is printed)."""
RESUMED = 2
RESUME_BOUND = 1e-12
"""The resumed runs start from the pipeline's state after STEPS steps, which differs from the reference's by at
most BOUND's per-step rounding (measured ~1e-16: update_equals_one_process_on_the_global_batch); each further
step adds its own rounding (~lr * 1e-15 as above) and moves an earlier difference d by at most (1 + lr * L) d for
SGD (L, the gradient's Lipschitz constant, O(1) on this tanh stack of width 8) or, for AdamW, by ~ d / |g| of
the O(1) gradients through the state: two more steps stay well below 1e-12 (the measured gap is printed). A lost
or misplaced optimizer state moves the weights by ~lr = 5e-2 (AdamW's first step is lr * sign(g))."""

CASES = {  # name -> (init keywords beyond pp=2, optimizer)
    "pp_gpipe_sgd": (dict(pp_schedule="gpipe", pp_microbatches=2), "sgd"),
    "pp_1f1b_sgd": (dict(pp_schedule="1f1b", pp_microbatches=4), "sgd"),
    "pp_gpipe_adamw": (dict(pp_schedule="gpipe", pp_microbatches=4), "adamw"),
    "pp_1f1b_adamw": (dict(pp_schedule="1f1b", pp_microbatches=2), "adamw"),
    "pp_split_1f1b_sgd": (dict(pp_schedule="1f1b", pp_microbatches=2, pp_split=["layers.3"]), "sgd"),
    "pp_fsdp_sgd": (dict(sharding="fsdp", pp_schedule="1f1b", pp_microbatches=2), "sgd"),
    "pp_fsdp_adamw": (dict(sharding="fsdp", pp_schedule="gpipe", pp_microbatches=2), "adamw"),
    # the plan is the whole model's: "embed" names a unit only stage 0 holds (stage 1 skips it)
    "pp_tp_adamw": (dict(tp=2, tp_plan={"embed": "colwise_gather_output", "layers.*.w1": "colwise",
                                        "layers.*.w2": "rowwise"}, pp_schedule="1f1b", pp_microbatches=2), "adamw"),
}


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(width, 2 * width)
        self.w2 = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.tanh(self.w1(x)))


class Stack(torch.nn.Module):
    """Embeddings, N blocks, head: the shape the default split cuts."""

    def __init__(self, features: int = 6, width: int = 8, layers: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(features, width)
        self.layers = torch.nn.ModuleList(Block(width) for _ in range(layers))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output, target)  # the mean over the microbatch


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def run_case(name: str) -> dict:
    keywords, kind = CASES[name]
    checks: dict = {}
    ud.init(pp=2, **keywords)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        tp = keywords.get("tp", 1)
        per_stage = world // 2  # ranks per stage; rank r sees the batches of data-parallel rank r // tp % dp
        dp = per_stage // tp
        stage = rank // per_stage
        torch.manual_seed(0)
        model = Stack().to(DTYPE)
        reference, initial = copy.deepcopy(model), copy.deepcopy(model)
        optimizer = _optimizer(kind, model.parameters())
        data = torch.utils.data.TensorDataset(torch.arange(ROWS), torch.randn(ROWS, 6, dtype=DTYPE),
                                              torch.randint(0, 3, (ROWS,)))
        loader = torch.utils.data.DataLoader(data, batch_size=PER_RANK, shuffle=True, drop_last=True)
        model, optimizer, loader = ud.prepare(model, optimizer, loader)
        owned = sorted(ud.unwrap(model).state_dict())
        from torch.distributed.tensor import DTensor

        split = sorted(n for n, p in ud.unwrap(model).named_parameters() if isinstance(p, DTensor))
        if keywords.get("sharding") == "fsdp":
            want_split = owned  # FSDP2 shards every parameter of the stage
        elif keywords.get("tp"):
            # the planned modules this stage holds: the embedding (stage 0 only) and the blocks' Linears
            want_split = [n for n in owned if n.startswith("embed.") or (n.startswith("layers.") and ".w" in n)]
        else:
            want_split = []
        checks["stage_is_split_as_the_layout_says"] = "ok" if split == want_split else f"FAIL: {split}"
        held = sum(len(g["params"]) for g in optimizer.param_groups)
        rows_seen, losses, gathered = [], [], []
        for step, (index, x, y) in enumerate(loader):
            if step == STEPS:
                break
            gathered.append(ud.gather_for_metrics(index).tolist())  # every stage calls it; the last one's rows count
            losses.append(float(ud.pipeline_step(model, x, y, loss_fn)))
            optimizer.step()
            optimizer.zero_grad()
            rows_seen.append(index.tolist())
        # refusals, the same on every rank before any communication
        try:
            model(x)
            checks["model_call_is_refused"] = "FAIL: model(x) ran"
        except ud.PipelineError as exc:
            checks["model_call_is_refused"] = "ok" if "pipeline_step" in str(exc) else f"FAIL: {exc}"
        try:
            ud.pipeline_step(model, x[:3], y[:3], loss_fn)
            checks["indivisible_batch_is_refused"] = "FAIL: a batch of 3 ran"
        except ud.PipelineError as exc:
            checks["indivisible_batch_is_refused"] = "ok" if "pp_microbatches" in str(exc) else f"FAIL: {exc}"
        # every rank's rows, over the whole world (plain torch.distributed, not the facade)
        everyone = [None] * world
        dist.all_gather_object(everyone, rows_seen)
        same_rows = all(everyone[r] == everyone[r % per_stage // tp * tp] for r in range(world))
        checks["every_stage_gets_the_same_batches"] = "ok" if same_rows else f"FAIL: {everyone}"
        # the reference: one process on each step's global batch
        ref_optimizer = _optimizer(kind, reference.parameters())
        _, all_x, all_y = data.tensors
        ref_losses = []
        global_rows = [[i for d in range(dp) for i in everyone[d * tp][step]] for step in range(STEPS)]
        checks["gather_for_metrics_gives_each_row_once"] = (
            "ok" if gathered == global_rows else f"FAIL: {gathered} != {global_rows}")
        for step in range(STEPS):
            rows = global_rows[step]
            mine = everyone[rank % per_stage][step]
            with torch.no_grad():
                ref_losses.append(float(loss_fn(reference(all_x[mine]), all_y[mine])))
            loss_fn(reference(all_x[rows]), all_y[rows]).backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        checks["loss_is_the_batch_mean_on_every_stage"] = "ok" if loss_diff <= BOUND else f"FAIL: {loss_diff:.3g}"
        expected = {0: ["embed", "layers.0", "layers.1"], 1: ["layers.2", "layers.3", "head"]}
        if keywords.get("pp_split"):
            expected = {0: ["embed", "layers.0", "layers.1", "layers.2"], 1: ["layers.3", "head"]}
        want = sorted(f"{unit}.{p}" for unit in expected[stage] for p in
                      (("weight", "bias") if unit in ("embed", "head") else
                       ("w1.weight", "w1.bias", "w2.weight", "w2.bias")))
        checks["stage_holds_its_units_by_full_name"] = "ok" if owned == want else f"FAIL: {owned} != {want}"
        checks["optimizer_steps_only_the_stage"] = "ok" if held == len(want) else f"FAIL: {held} != {len(want)}"
        state = ud.unwrap(model).state_dict()
        ref_state = reference.state_dict()
        diffs = {k: float((_full(v).detach() - ref_state[k]).abs().max()) for k, v in sorted(state.items())}
        moved = max(float((ref_state[k] - v).abs().max()) for k, v in initial.state_dict().items())
        max_diff = max(diffs.values())
        checks["update_equals_one_process_on_the_global_batch"] = (
            "ok" if max_diff <= BOUND and moved > 1e-3 else f"FAIL: max diff {max_diff:.3g}, moved {moved:.3g}")
        # the portable checkpoint: every stage's weights in one file, by name, that one plain process loads
        path = os.path.join(OUT, f"{name}.pt")
        ud.save({"model": model}, path)
        saved = torch.load(path, weights_only=True)["model"]
        whole = Stack().to(DTYPE)
        try:
            whole.load_state_dict(saved)  # strict: every name of the whole model, nothing else
            gap = max(float((whole.state_dict()[k] - v).abs().max()) for k, v in ref_state.items())
            checks["save_gathers_every_stage_by_name"] = "ok" if gap <= BOUND else f"FAIL: {gap:.3g}"
        except RuntimeError as exc:
            checks["save_gathers_every_stage_by_name"] = f"FAIL: {sorted(saved)}: {exc}"[:600]
        with torch.no_grad():
            for p in ud.unwrap(model).parameters():
                p.zero_()
        ud.load(path, {"model": model})
        back = max(float((_full(v).detach() - saved[k]).abs().max())  # bitwise what the file holds
                   for k, v in ud.unwrap(model).state_dict().items())
        checks["load_gives_each_stage_its_part"] = "ok" if back == 0.0 else f"FAIL: {back:.3g}"
        # the optimizer's state moves both ways between this pipeline and one plain process (the file's layout
        # is torch's positional one over the whole model): (a) the pipeline saves model and optimizer, one plain
        # process loads both and takes RESUMED more steps; (b) a plain process's checkpoint (as its ud.save
        # writes one: the state dicts) loads into the pipeline, whose optimizer state was emptied first, and the
        # pipeline takes the same steps. Both must end where the plain reference ends after STEPS + RESUMED
        # uninterrupted steps on the same global batches (RESUME_BOUND derives the bound).
        with_optimizer = os.path.join(OUT, f"{name}_plain_rank{rank}.pt")
        torch.save({"model": copy.deepcopy(reference.state_dict()),
                    "optimizer": copy.deepcopy(ref_optimizer.state_dict())}, with_optimizer)
        generator = torch.Generator().manual_seed(11)
        later = [(torch.randn(dp * PER_RANK, 6, dtype=DTYPE, generator=generator),
                  torch.randint(0, 3, (dp * PER_RANK,), generator=generator)) for _ in range(RESUMED)]
        for x_all, y_all in later:  # the reference goes on uninterrupted
            loss_fn(reference(x_all), y_all).backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        opt_path = os.path.join(OUT, f"{name}_with_optimizer.pt")
        ud.save({"model": model, "optimizer": optimizer}, opt_path)
        resumed = Stack().to(DTYPE)
        resumed_optimizer = _optimizer(kind, resumed.parameters())
        written = torch.load(opt_path, weights_only=True)
        resumed.load_state_dict(written["model"])
        resumed_optimizer.load_state_dict(written["optimizer"])
        for x_all, y_all in later:
            loss_fn(resumed(x_all), y_all).backward()
            resumed_optimizer.step()
            resumed_optimizer.zero_grad()
        end = reference.state_dict()
        gap_a = max(float((v - end[k]).abs().max()) for k, v in resumed.state_dict().items())
        checks["optimizer_state_saved_by_name_resumes_in_one_plain_process"] = (
            "ok" if gap_a <= RESUME_BOUND else f"FAIL: {gap_a:.3g}")
        with torch.no_grad():
            for p in ud.unwrap(model).parameters():
                p.zero_()
        optimizer.state.clear()  # what the file holds must come back
        ud.load(with_optimizer, {"model": model, "optimizer": optimizer})
        mine = slice(rank % per_stage // tp * PER_RANK, (rank % per_stage // tp + 1) * PER_RANK)
        for x_all, y_all in later:
            ud.pipeline_step(model, x_all[mine], y_all[mine], loss_fn)
            optimizer.step()
            optimizer.zero_grad()
        gap_b = max(float((_full(v).detach() - end[k]).abs().max()) for k, v in ud.unwrap(model).state_dict().items())
        checks["a_plain_checkpoint_with_optimizer_resumes_on_every_stage"] = (
            "ok" if gap_b <= RESUME_BOUND else f"FAIL: {gap_b:.3g}")
        resume_diff = max(gap_a, gap_b)
        ud.load(path, {"model": model})  # back to what ``whole`` holds, for the checks below
        # a batch of other shapes (8 rows, which 2 and 4 microbatches divide: a schedule of its own), the clip
        # over every stage's gradients, and the forward for evaluation (5 rows: one microbatch); the reference is
        # ``whole``, which holds what each stage now holds (the file just loaded). The last data-parallel rank
        # passes the 8 rows of x6, the others (FSDP's 2 data-parallel ranks) its first 4, the shape of the
        # training batches: the stage's ranks must still build the new schedule together. The step's gradient:
        # the mean over the data-parallel ranks of their batches' mean-loss gradients (FSDP2 averages them),
        # which the reference forms the same way.
        generator = torch.Generator().manual_seed(7)
        x6, y6 = torch.randn(8, 6, dtype=DTYPE, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        rows_of = [8 if d == dp - 1 else PER_RANK for d in range(dp)]
        mine6 = rows_of[rank % per_stage // tp]
        optimizer.zero_grad()
        loss6 = float(ud.pipeline_step(model, x6[:mine6], y6[:mine6], loss_fn))
        norm = float(ud.clip_grad_norm_(model.parameters(), 1e-3))
        ref_losses6 = [loss_fn(whole(x6[:n]), y6[:n]) for n in rows_of]
        (sum(ref_losses6) / dp).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(whole.parameters(), 1e-3))
        gap6 = abs(loss6 - float(ref_losses6[rank % per_stage // tp]))
        checks["a_batch_of_other_shapes_runs_its_own_schedule"] = "ok" if gap6 <= BOUND else f"FAIL: {gap6:.3g}"
        grad_gap = max(float((_full(p.grad) - whole.get_parameter(n).grad).abs().max())
                       for n, p in ud.unwrap(model).named_parameters())
        checks["clip_grad_norm_clips_to_the_whole_models_norm"] = (
            "ok" if abs(norm - ref_norm) <= BOUND and grad_gap <= BOUND and ref_norm > 1e-3
            else f"FAIL: norm {norm} != {ref_norm} or grads {grad_gap:.3g}")
        optimizer.zero_grad()
        with torch.no_grad():
            out = ud.pipeline_forward(model, x6[:5])
            want = whole(x6[:5])
        if stage == 1:
            gap = float((out - want).abs().max()) if out.shape == want.shape else float("inf")
            ok = gap <= BOUND and not out.requires_grad
        else:  # the other stage: no rows, the output's dtype and trailing shape
            ok, gap = out.shape == (0, 3) and out.dtype == DTYPE, None
        checks["pipeline_forward_gives_the_outputs_on_the_last_stage_only"] = (
            "ok" if ok else f"FAIL: {tuple(out.shape)} {out.dtype} {gap}")
        # stages whose optimizers have different numbers of param groups (stage 0 two, stage 1 one; a user who
        # drops an empty group on one stage) are refused in one line on every rank, save and load alike, before
        # anything is written: no rank is left waiting in a collective the others never reach
        own = list(ud.unwrap(model).parameters())
        odd = torch.optim.SGD([{"params": own[:1]}, {"params": own[1:]}] if stage == 0 else own, lr=0.1)
        odd_path = os.path.join(OUT, f"{name}_odd_groups.pt")
        wrong = []
        for what, call in (("save", lambda: ud.save({"model": model, "optimizer": odd}, odd_path)),
                           ("load", lambda: ud.load(opt_path, {"model": model, "optimizer": odd}))):
            try:
                call()
                wrong.append(f"{what} went on")
            except ud.CheckpointError as exc:
                if "different numbers of param groups" not in str(exc) or "\n" in str(exc):
                    wrong.append(f"{what}: {exc}")
        if os.path.exists(odd_path):
            wrong.append("the save wrote a file")
        checks["stages_with_other_param_groups_are_refused_on_every_rank"] = (
            "ok" if not wrong else f"FAIL: {'; '.join(wrong)}"[:600])
        # last (it spoils the gradients): a NaN input reaches only the last stage's loss, yet every rank stops
        try:
            ud.pipeline_step(model, torch.full_like(x, float("nan")), y, loss_fn)
            checks["non_finite_loss_stops_every_stage"] = "FAIL: a NaN loss went on"
        except ud.NonFiniteLoss as exc:
            checks["non_finite_loss_stops_every_stage"] = "ok" if "not finite" in str(exc) else f"FAIL: {exc}"
        return {"case": name, "rank": rank, "stage": stage, "checks": checks, "max_diff": max_diff,
                "loss_diff": loss_diff, "resume_diff": resume_diff}
    finally:
        ud.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True, help="a folder every rank sees (checkpoints)")
    args = parser.parse_args()
    global OUT
    OUT = args.out
    torch.set_num_threads(1)
    for name in args.cases.split(","):
        try:
            record = run_case(name)
        except Exception:  # noqa: BLE001 - reported as the case's failure, in its own line
            record = {"case": name, "rank": int(os.environ.get("RANK", -1)),
                      "checks": {"ran": "FAIL: " + traceback.format_exc()[-1500:]}}
        os.write(1, (json.dumps(record) + "\n").encode())


if __name__ == "__main__":
    main()
