"""The deepspeed backend's physics under a real launcher (tests/launchers/test_deepspeed_engine.py).

One launch (2 ranks) trains the same tiny model through the facade's loop for every case: ZeRO stage 0-3 x
(SGD with momentum, AdamW) x gradient accumulation 1 and 2, each in its own ``ud.init(backend="deepspeed",
zero_stage=S, gradient_accumulation_steps=K)`` ... ``ud.shutdown()`` session, then the same loop on the torch
backend (DDP). Each rank writes the final full weights of every case (read with DeepSpeed's own
``safe_get_full_fp32_param``, independent of the facade) to ``--out/rank{r}.json``; the test compares them with
plain single-process torch computed in the test process. Data and model are literal functions of a seed, so the
test rebuilds them exactly (:func:`data`, :func:`model`).
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


def train(ud, backend: Optional[str], stage: Optional[int], opt_name: str, k: int,
          clip: Optional[float] = None) -> dict:
    """The facade's loop; returns the final full weights by parameter name (flattened lists), which backend,
    launcher and ZeRO stage ran it, and the optimizer state this rank holds. ``backend``/``stage`` ``None``:
    whatever the launcher and the environment say; ``clip``: ``ud.clip_grad_norm_(..., clip)`` before each step
    (its norms are returned too)."""
    ud.init(backend=backend, gradient_accumulation_steps=k, zero_stage=stage)
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
    checkpoint = save_and_load(ud, prepared, opt, stage) if backend == "deepspeed" and opt_name == "sgd" \
        and k == 1 and clip is None and OUT is not None else None
    out = {"checkpoint": checkpoint, "backend": ud.backend_name(), "launcher": ud.launcher(),
           "world_size": ud.world_size(),
           "stage": engine_stage, "inner": type(ud.unwrap(prepared)).__name__, "held": held, "steps": opt.steps_taken,
           "norms": norms,
           "weights": {n: w.double().flatten().tolist() for n, w in weights.items()}}
    ud.shutdown()
    return out


OUT: Optional[Path] = None  # --out: where the checkpoint cases write


def save_and_load(ud, model, optimizer, stage: int) -> dict:
    """What ud.save and ud.load do with the prepared model and optimizer under this stage: the file written
    (``None``) or the one-line error, per call."""
    path = OUT / f"zero{stage}-model.pt"
    outcome = {}
    for name, call in (("save_model", lambda: ud.save({"model": model}, str(path))),
                       ("save_optimizer", lambda: ud.save({"optimizer": optimizer}, str(OUT / "optimizer.pt"))),
                       ("load_model", lambda: ud.load(str(OUT / "zero0-model.pt"), {"model": model}))):
        try:
            call()
            outcome[name] = None
        except ud.UnifiedDistError as exc:
            outcome[name] = {"type": type(exc).__name__, "message": str(exc)}
        ud.barrier()
    outcome["file"] = str(path)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # DeepSpeed's launcher passes it
    parser.add_argument("--detected", action="store_true",
                        help="one case (SGD, no accumulation), backend and stage as the launcher and environment say")
    args = parser.parse_args()
    import unified_dist as ud

    global OUT
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)

    results = {}
    if args.detected:
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
                    results[case_name("deepspeed", stage, opt_name, k)] = train(ud, "deepspeed", stage, opt_name, k)
            results[f"deepspeed-zero{stage}-clip"] = train(ud, "deepspeed", stage, "sgd", 1, clip=CLIP)
        for opt_name in OPTIMIZERS:
            for k in ACCUMULATIONS:
                results[case_name("torch", 0, opt_name, k)] = train(ud, "torch", None, opt_name, k)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(results))
    print("deepspeed worker done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
