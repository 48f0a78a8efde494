"""The deepspeed backend's physics under a real launcher (tests/launchers/test_deepspeed_engine.py).

One launch (2 ranks) trains the same tiny model through the facade's loop for every case: ZeRO stage 0-3 x
(SGD with momentum, AdamW) x gradient accumulation 1 and 2, each in its own ``ud.init(backend="deepspeed",
zero_stage=S, gradient_accumulation_steps=K)`` ... ``ud.shutdown()`` session, ZeRO 1-3 once more with the optimizer
offloaded (and ZeRO-3's parameters), then the same loop on the torch backend (DDP). Each rank writes the final
full weights of every case (read with DeepSpeed's own ``safe_get_full_fp32_param``, independent of the facade) to
``--out/rank{r}.json``; the test compares them with
plain single-process torch computed in the test process. Data and model are literal functions of a seed, so the
test rebuilds them exactly (:func:`data`, :func:`model`). With ``--checkpoints`` the launch then runs the portable
checkpoints' reshard chain (:func:`chain_leg`) and a plain DeepSpeed script's checkpoint
(:func:`plain_deepspeed_checkpoint`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

import torch

ROWS, FEATURES, OUTPUTS, BATCH = 48, 4, 2, 4  # 2 ranks x batch 4: global batches of 8, six of them per epoch
STAGES = (0, 1, 2, 3)
OPTIMIZERS = ("sgd", "adamw")
ACCUMULATIONS = (1, 2)
CLIP = 0.2  # ud.clip_grad_norm_'s max_norm in the clipping cases: below every step's gradient norm here (>= 0.26)


def data() -> tuple:
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, FEATURES, generator=g), torch.randn(ROWS, OUTPUTS, generator=g)


def model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 3), torch.nn.Tanh(), torch.nn.Linear(3, OUTPUTS))


def optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def case_name(backend: str, stage: int, opt: str, k: int) -> str:
    return f"{backend}-zero{stage}-{opt}-k{k}" if backend == "deepspeed" else f"{backend}-{opt}-k{k}"


LAUNCHER_RANKS = ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
"""The variables in which torchrun (and DeepSpeed's launcher), horovodrun, mpirun and srun give a process its rank."""


def train(ud, backend: Optional[str], stage: Optional[int], opt_name: str, k: int,
          clip: Optional[float] = None, checkpoint: bool = False, offload: bool = False) -> dict:
    """The facade's loop; returns the final full weights by parameter name (flattened lists), which backend,
    launcher and ZeRO stage ran it, the rank the session gave this process and those its launcher's variables
    said, torch.distributed's backend and whether Horovod's library was started, and the optimizer state this rank
    holds. ``backend``/``stage`` ``None``: whatever the launcher and the environment say; ``clip``:
    ``ud.clip_grad_norm_(..., clip)`` before each step (its norms are returned too); ``checkpoint``: then
    :func:`save_and_load`; ``offload``: ``offload_optimizer="cpu"`` (and ``offload_param="cpu"`` at ZeRO-3), then
    :func:`save_offloaded`. Also returned: where the engine offloads and the clipping it applies in its step."""
    ud.init(backend=backend, gradient_accumulation_steps=k, zero_stage=stage,
            offload_optimizer="cpu" if offload else None, offload_param="cpu" if offload and stage == 3 else None)
    x, y = data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    net = model()
    prepared, opt, loader = ud.prepare(net, optimizer(opt_name, net.parameters()), loader)
    norms = []
    for xb, yb in loader:
        with ud.accumulate(prepared):
            loss = torch.nn.functional.mse_loss(prepared(xb), yb)
            ud.backward(loss)
            if clip is not None:
                norms.append(float(ud.clip_grad_norm_(prepared.parameters(), clip)))
            opt.step()
            opt.zero_grad()
    inner = ud.unwrap(prepared)
    engine_stage = prepared.zero_optimization_stage() if ud.backend_name() == "deepspeed" else None
    held = sum(t.numel() for state in opt.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)  # optimizer state elements on this rank
    if engine_stage:  # ZeRO's fp32 master weights, gathered by DeepSpeed itself
        from deepspeed.utils import safe_get_full_fp32_param

        weights = {n: safe_get_full_fp32_param(p).detach().cpu() for n, p in inner.named_parameters()}
    else:
        weights = {n: p.detach().cpu() for n, p in inner.named_parameters()}
    horovod = sys.modules.get("horovod.torch")
    engine = prepared if ud.backend_name() == "deepspeed" else None
    out = {"checkpoint": save_and_load(ud, prepared, opt, stage) if checkpoint else None,
           "offloaded_file": save_offloaded(ud, prepared, opt, stage) if offload else None,
           "offload": {what: getattr(getattr(engine, f"zero_offload_{what}")() if engine else None, "device", None)
                       for what in ("optimizer", "param")},
           "clipping": engine.gradient_clipping() if engine else None,
           "backend": ud.backend_name(), "launcher": ud.launcher(), "world_size": ud.world_size(),
           "rank": ud.rank(), "launcher_ranks": {k: os.environ.get(k) for k in LAUNCHER_RANKS},
           "group": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
           "horovod_started": bool(horovod is not None and horovod.is_initialized()),
           "stage": engine_stage, "inner": type(ud.unwrap(prepared)).__name__, "held": held, "steps": opt.steps_taken,
           "norms": norms,
           "weights": {n: w.double().flatten().tolist() for n, w in weights.items()}}
    ud.shutdown()
    return out


OUT: Optional[Path] = None  # --out: where the checkpoint cases write


def save_and_load(ud, model, optimizer, stage: int) -> dict:
    """What ud.save and ud.load do with the prepared model and optimizer under this stage: the file written
    (``None``) or the one-line error, per call."""
    path, optimizer_path = OUT / f"zero{stage}-model.pt", OUT / f"zero{stage}-optimizer.pt"
    outcome = {}
    for name, call in (("save_model", lambda: ud.save({"model": model}, str(path))),
                       ("save_optimizer", lambda: ud.save({"optimizer": optimizer}, str(optimizer_path))),
                       ("load_model", lambda: ud.load(str(OUT / "zero0-model.pt"), {"model": model}))):
        try:
            call()
            outcome[name] = None
        except ud.UnifiedDistError as exc:
            outcome[name] = {"type": type(exc).__name__, "message": str(exc)}
        ud.barrier()
    outcome["file"] = str(path)
    outcome["optimizer_file"] = str(optimizer_path)
    return outcome


def save_offloaded(ud, model, optimizer, stage: int) -> str:
    """``ud.save`` of the model and optimizer whose state the engine keeps offloaded: the file's path."""
    path = OUT / f"zero{stage}-offload.pt"
    ud.save({"model": model, "optimizer": optimizer}, str(path))
    return str(path)


CHAIN = {  # the reshard chain's legs in these processes, in order; the test runs the last leg, 1 process
    "ddp": dict(backend="torch"),
    "zero1": dict(backend="deepspeed", zero_stage=1),
    "zero2": dict(backend="deepspeed", zero_stage=2),
    "zero3": dict(backend="deepspeed", zero_stage=3),
    "fsdp2": dict(backend="torch", sharding="fsdp"),
}
CHAIN_STEPS = 2  # AdamW steps per leg, each on the next global batch of 2 x BATCH rows (chain_rows)


def chain_rows(step: int) -> list:
    """The rows of global batch ``step`` in the chain: the data's batches in order, again from the start after
    the last one."""
    return [(step * 2 * BATCH + j) % ROWS for j in range(2 * BATCH)]


def witness(ud, prepared, opt) -> dict:
    """The full float32 weights and AdamW state by parameter name, read with each engine's own API and not through
    the facade's checkpoints: DeepSpeed's ``safe_get_full_fp32_param``/``safe_get_full_optimizer_state`` under ZeRO
    (its step from the optimizer's own state), ``DTensor.full_tensor`` under FSDP2, the tensors themselves under
    DDP. A collective; values as lists."""
    inner = ud.unwrap(prepared)
    user = opt
    while not type(user).__module__.startswith("torch.optim"):
        user = user.optimizer
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    weights, moments = {}, {}
    step = float(next(iter(user.state.values()))["step"])  # one count for every parameter (and partition)
    if ud.backend_name() == "deepspeed" and prepared.zero_optimization_stage():
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        for n, p in inner.named_parameters():
            weights[n] = safe_get_full_fp32_param(p)
            moments[n] = {k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")}
    else:
        for n, p in inner.named_parameters():
            weights[n] = full(p.detach())
            moments[n] = {k: full(user.state[p][k]) for k in ("exp_avg", "exp_avg_sq")}
    as_list = lambda t: t.detach().cpu().double().flatten().tolist()  # noqa: E731
    return {"step": step, "weights": {n: as_list(w) for n, w in weights.items()},
            "moments": {n: {k: as_list(v) for k, v in m.items()} for n, m in moments.items()}}


def chain_leg(ud, index: int, name: str) -> dict:
    """One leg of the chain: a fresh model and AdamW prepared under ``CHAIN[name]``, the previous leg's
    ``ud.save`` file loaded into them (model, optimizer, step), CHAIN_STEPS steps, ``ud.save`` again; the witness
    just after the load and at the end."""
    ud.init(**CHAIN[name])
    net = model()
    prepared, opt = ud.prepare(net, optimizer("adamw", net.parameters()))
    out: dict = {"backend": ud.backend_name(), "world_size": ud.world_size(),
                 "stage": prepared.zero_optimization_stage() if ud.backend_name() == "deepspeed" else None}
    start = 0
    if index:
        extra = ud.load(str(OUT / f"chain{index - 1}.pt"), {"model": prepared, "optimizer": opt})
        start = extra["step"]
        out["loaded"] = witness(ud, prepared, opt)
        out["steps_taken_loaded"] = opt.steps_taken
    x, y = data()
    mine = slice(ud.rank() * BATCH, (ud.rank() + 1) * BATCH)
    for step in range(start, start + CHAIN_STEPS):
        rows = chain_rows(step)[mine]
        ud.backward(torch.nn.functional.mse_loss(prepared(x[rows]), y[rows]))
        opt.step()
        opt.zero_grad()
    ud.save({"model": prepared, "optimizer": opt, "step": start + CHAIN_STEPS}, str(OUT / f"chain{index}.pt"))
    out["saved"] = witness(ud, prepared, opt)
    out["file"] = str(OUT / f"chain{index}.pt")
    ud.barrier()  # the file is whole before the next leg reads it
    ud.shutdown()
    return out


def plain_deepspeed_checkpoint(ud) -> dict:
    """What a plain DeepSpeed script does, on the process group of a torch-backend session (none of the facade's
    objects): ``deepspeed.initialize`` under ZeRO-3 with AdamW, CHAIN_STEPS steps, ``engine.save_checkpoint(dir)``.
    Returns the directory and the weights it ended with (DeepSpeed's ``safe_get_full_fp32_param``)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    ud.init(backend="torch")
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)
    net = model()
    config = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": 3},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 2**62}
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer("adamw", net.parameters()), config=config,
                                           dist_init_required=False)
    x, y = data()
    mine = slice(ud.rank() * BATCH, (ud.rank() + 1) * BATCH)
    for step in range(CHAIN_STEPS):
        rows = chain_rows(step)[mine]
        engine.backward(torch.nn.functional.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    directory = OUT / "deepspeed_checkpoint"
    engine.save_checkpoint(str(directory))
    weights = {n: safe_get_full_fp32_param(p).double().flatten().tolist() for n, p in engine.module.named_parameters()}
    torch.distributed.barrier()
    engine.destroy()
    ud.shutdown()
    return {"directory": str(directory), "weights": weights}


def checkpoints(ud, results: dict) -> None:
    """The reshard chain's legs, then the plain DeepSpeed script's checkpoint."""
    for index, name in enumerate(CHAIN):
        results[f"chain-{name}"] = chain_leg(ud, index, name)
    results["plain-deepspeed"] = plain_deepspeed_checkpoint(ud)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # DeepSpeed's launcher passes it
    parser.add_argument("--detected", action="store_true",
                        help="one case (SGD, no accumulation), backend and stage as the launcher and environment say")
    parser.add_argument("--stage", type=int, default=None,
                        help="one case (SGD, no accumulation) of ud.init(backend='deepspeed', zero_stage=STAGE)")
    parser.add_argument("--checkpoints", action="store_true",
                        help="then the reshard chain and a plain DeepSpeed script's checkpoint")
    args = parser.parse_args()
    import unified_dist as ud

    global OUT
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)

    results = {}
    if args.stage is not None:
        results[f"code-zero{args.stage}-sgd-k1"] = train(ud, "deepspeed", args.stage, "sgd", 1)
    elif args.detected:
        results["detected-sgd-k1"] = train(ud, None, None, "sgd", 1)
        if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":  # another backend would train plain DDP
            try:
                ud.init(backend="accelerate")
                results["refused"] = None
            except ud.UnifiedDistError as exc:
                results["refused"] = {"type": type(exc).__name__, "message": str(exc)}
            ud.shutdown()
    else:
        for stage in STAGES:
            for opt_name in OPTIMIZERS:
                for k in ACCUMULATIONS:
                    results[case_name("deepspeed", stage, opt_name, k)] = train(
                        ud, "deepspeed", stage, opt_name, k, checkpoint=opt_name == "sgd" and k == 1)
            results[f"deepspeed-zero{stage}-clip"] = train(ud, "deepspeed", stage, "sgd", 1, clip=CLIP)
            if stage:  # ZeRO-Offload: the optimizer's partitions (and ZeRO-3's parameters) in CPU memory
                results[f"deepspeed-zero{stage}-offload"] = train(ud, "deepspeed", stage, "adamw", 2, offload=True)
        for opt_name in OPTIMIZERS:
            for k in ACCUMULATIONS:
                results[case_name("torch", 0, opt_name, k)] = train(ud, "torch", None, opt_name, k)
    if args.checkpoints:  # each leg names its engine in code: the launch's choice (UNIFIED_DIST_*) is dropped first
        for variable in ("UNIFIED_DIST_BACKEND", "UNIFIED_DIST_ZERO_STAGE"):
            os.environ.pop(variable, None)
        checkpoints(ud, results)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rank = next(case["rank"] for case in results.values() if case and "rank" in case)  # srun/mpirun: no RANK
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(results))
    print("deepspeed worker done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
