"""The checks of ``unified-dist test --gpu`` (:mod:`.gpu` runs them), one function each.

Each check takes the device to check (``cuda``; ``cpu`` for the dry run that exercises every check's
code on a machine without a GPU) and returns an :class:`Outcome`: whether it passed and its figure
(an error against a CPU float64 reference, a count, a time). An exception is a failure of that
check only. The paths are unified_dist's own where unified_dist has one (``prepare`` with FSDP2,
CPU offload, fp16, ``compile``; ``ud.save``/``ud.load`` of ``ud.RNG``; the mesh and TP-plan
functions), at world size 1 (``ud.init("torch")`` joins a one-process group: NCCL on a GPU); the
synchronised BatchNorms need two ranks, so they run two processes on the one device over gloo
(NCCL refuses two ranks on one GPU).

Run as ``python -m unified_dist.checks.gpu_checks --device cuda --out DIR NAME...``: for each NAME it
writes ``DIR/NAME.json``, first ``{"status": "running"}`` (the parent times it from there), then the
outcome. ``--rank-of NAME`` instead runs one rank of a two-process check (see :func:`_sync_bn_rank`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

import unified_dist as ud

CHECKS: Dict[str, Callable[[torch.device], "Outcome"]] = {}
"""Every check by name, in the order they run (the names :data:`unified_dist.checks.gpu.CHECKS` lists)."""

SYNC_WARNING = "synchroniz"
"""What the warnings of ``torch.cuda.set_sync_debug_mode("warn")`` say ("called a synchronizing CUDA operation")."""


@dataclass
class Outcome:
    """A check's result: ``passed``, its ``figure`` (a number or a small mapping of them), the
    ``limit`` the figure was held to, and a one-line ``detail``."""

    passed: bool
    figure: Any
    limit: Any = None
    detail: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)
    skipped: bool = False

    @property
    def status(self) -> str:
        return "skip" if self.skipped else "pass" if self.passed else "FAIL"


def check(fn: Callable[[torch.device], Outcome]) -> Callable[[torch.device], Outcome]:
    CHECKS[fn.__name__] = fn
    return fn


# ---------------------------------------------------------------------- the model and its reference
class Block(nn.Module):
    """A residual MLP block: what FSDP2 shards one by one and the TP plan splits (w1 colwise, w2 rowwise)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, 2 * width)
        self.w2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(x)))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


TP_PLAN = {"blocks.*.w1": "colwise", "blocks.*.w2": "rowwise"}


def net(width: int = 16) -> Net:
    """The same initial weights every time."""
    torch.manual_seed(0)
    return Net(width)


def batches(steps: int, width: int = 16, batch: int = 8) -> List[tuple]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(steps)]


def reference(data: Sequence[tuple], optimizer: str = "SGD", **options: Any) -> List[torch.Tensor]:
    """The parameters after training :func:`net` on ``data`` in one CPU process in float64
    (``torch.optim.<optimizer>(**options)``, by default SGD with lr 0.1)."""
    model = net().double()
    opt = getattr(torch.optim, optimizer)(model.parameters(), **(options or {"lr": 0.1}))
    for x, y in data:
        nn.functional.mse_loss(model(x.double()), y.double()).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value on the CPU in float64 (a DTensor gathered)."""
    p = p.detach()
    if hasattr(p, "full_tensor"):
        p = p.full_tensor()
    return p.double().cpu()


def max_error(model: nn.Module, ref: Sequence[torch.Tensor]) -> float:
    params = list(model.parameters())
    if len(params) != len(ref):
        raise AssertionError(f"{len(params)} parameters, the reference has {len(ref)}")
    return max(float((full(p) - r).abs().max()) for p, r in zip(params, ref))


def with_optimizer(model: nn.Module, optimizer: str = "SGD", **options: Any) -> tuple:
    """``(model, torch.optim.<optimizer>(its parameters, **options))`` (SGD, lr 0.1 by default), for
    ``ud.prepare``."""
    return model, getattr(torch.optim, optimizer)(model.parameters(), **(options or {"lr": 0.1}))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: Sequence[tuple], device: torch.device,
          facade: bool = True) -> None:
    """SGD steps on ``data`` through ``ud.backward`` (``facade``) or plain ``backward``."""
    for x, y in data:
        with ud.autocast():
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        ud.backward(loss) if facade else loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@contextlib.contextmanager
def session(device: torch.device, **settings: Any) -> Iterator[torch.device]:
    """``ud.init("torch", **settings)`` (a one-process group: NCCL on a GPU, gloo on a CPU) until the block ends."""
    ud.init("torch", **settings)
    try:
        if ud.device().type != device.type:
            raise AssertionError(f"unified_dist chose {ud.device()}, the check is for {device.type}")
        yield ud.device()
    finally:
        ud.shutdown()


def compared(error: float, limit: float, what: str) -> Outcome:
    return Outcome(error <= limit, error, limit, f"max |param - CPU float64 reference| after {what}")


# ---------------------------------------------------------------------- sharding
@check
def fsdp2(device: torch.device) -> Outcome:
    """FSDP2 through ``prepare`` (``sharding="fsdp"``): 3 SGD steps equal the CPU float64 run."""
    data = batches(3)
    with session(device, sharding="fsdp") as dev:
        model, opt = ud.prepare(*with_optimizer(net()))
        p = next(model.parameters())
        if not hasattr(p, "placements") or p.device.type != device.type:
            raise AssertionError(f"prepare left a {type(p).__name__} on {p.device}, not a DTensor on {device.type}")
        train(model, opt, data, dev)
        return compared(max_error(model, reference(data)), 1e-4, "3 SGD steps")


@check
def hsdp(device: torch.device) -> Outcome:
    """HSDP's 2-D placement (Replicate, Shard) on a (1, 1) device mesh: 3 SGD steps equal the reference."""
    from torch.distributed.tensor import Replicate, Shard

    from ..parallel.mesh import Layout
    from ..parallel.sharding import Sharding, shard_model

    data = batches(3)
    with session(device) as dev:
        mesh = Layout(1, 1, 1).build_mesh(dev.type)
        model = shard_model(net().to(dev), Sharding(mode="fsdp", dp_replicate=1), None,
                            dp_mesh=mesh["dp_replicate", "dp_shard"])
        placements = tuple(next(model.parameters()).placements)
        if placements != (Replicate(), Shard(0)):
            raise AssertionError(f"placements {placements}, not (Replicate(), Shard(0))")
        train(model, torch.optim.SGD(model.parameters(), lr=0.1), data, dev, facade=False)
        return compared(max_error(model, reference(data)), 1e-4, "3 SGD steps")


@check
def tensor_parallel(device: torch.device) -> Outcome:
    """The TP plan (w1 colwise, w2 rowwise) applied on a 1-rank ``tp`` mesh: 3 SGD steps equal the reference."""
    from torch.distributed.tensor import Shard

    from ..parallel.mesh import Layout
    from ..parallel.sharding import point_optimizer_at
    from ..parallel.tensor_parallel import apply_tp_plan

    data = batches(3)
    with session(device) as dev:
        mesh = Layout(1, 1, 1).build_mesh(dev.type)
        model = apply_tp_plan(net().to(dev), TP_PLAN, mesh["tp"])
        w1 = model.blocks[0].w1.weight
        if tuple(w1.placements) != (Shard(0),):
            raise AssertionError(f"w1's placement is {tuple(w1.placements)}, not colwise (Shard(0),)")
        # the plain head stays beside DTensors: ud.prepare's optimizer rule (CUDA's foreach kernels refuse the mix)
        optimizer = point_optimizer_at(torch.optim.SGD(model.parameters(), lr=0.1), lambda p: p)
        train(model, optimizer, data, dev, facade=False)
        return compared(max_error(model, reference(data)), 1e-4, "3 SGD steps")


@check
def pinned_cpu_offload(device: torch.device) -> Outcome:
    """``cpu_offload=True``: FSDP2 keeps the shards on the CPU, pinned where there is a GPU, and trains
    to the reference."""
    data = batches(3)
    with session(device, sharding="fsdp", cpu_offload=True) as dev:
        model, opt = ud.prepare(*with_optimizer(net()))
        local = next(model.parameters()).to_local()
        want_pinned = device.type == "cuda"
        if local.device.type != "cpu" or local.is_pinned() != want_pinned:
            raise AssertionError(f"the shard is on {local.device}, pinned={local.is_pinned()}; "
                                 f"expected the CPU, pinned={want_pinned}")
        train(model, opt, data, dev)
        outcome = compared(max_error(model, reference(data)), 1e-4, "3 SGD steps")
        outcome.extra["pinned"] = local.is_pinned()
        return outcome


# ---------------------------------------------------------------------- the hot path
@contextlib.contextmanager
def counting_syncs(device: torch.device) -> Iterator[List[Any]]:
    """The warnings that ``torch.cuda.set_sync_debug_mode("warn")`` raises inside the block, one per
    host sync (a list of warnings; count them with :func:`syncs`). On a CPU nothing syncs: none."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            yield seen
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")


def syncs(seen: Sequence[Any]) -> int:
    return sum(SYNC_WARNING in str(w.message) for w in seen)


@check
def host_syncs_per_micro_step(device: torch.device) -> Outcome:
    """With 2 accumulation steps: 0 host syncs on the micro-step that only accumulates, at most 1
    (the non-finite exchange) on the one that synchronises (docs/hot-path.md), after a warm-up step."""
    k, windows = 2, 3
    data = [(x.to(device), y.to(device)) for x, y in batches(k * windows)]
    counts = []
    with session(device, gradient_accumulation_steps=k):
        model, opt = ud.prepare(*with_optimizer(net()))
        for x, y in data:
            with counting_syncs(device) as seen:
                with ud.accumulate(model):
                    ud.backward(nn.functional.mse_loss(model(x), y))
                    opt.step()
                    opt.zero_grad()
            counts.append(syncs(seen))
    measured = counts[k:]  # the first optimizer step builds DDP's buckets
    quiet, syncing = measured[0::k][:windows - 1], measured[k - 1::k]
    passed = all(c == 0 for c in quiet) and all(c <= 1 for c in syncing)
    figure = {"per_micro_step": counts, "accumulating_max": max(quiet), "synchronising_max": max(syncing)}
    return Outcome(passed, figure,
                   {"accumulating": 0, "synchronising": 1},
                   f"host syncs per micro-step (sync debug mode 'warn'; the first {k} are the warm-up step)")


def _compile_subject(device: torch.device):
    """(model factory, batch, what it is): a 2-layer BERT on a GPU when transformers is installed, else
    a wide MLP (the dry run keeps to the MLP: a CPU compiles BERT for minutes)."""
    if device.type == "cuda":
        with contextlib.suppress(ImportError):
            from transformers import BertConfig, BertForSequenceClassification

            config = BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=1024, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

            def bert():
                torch.manual_seed(0)
                return BertForSequenceClassification(config)
            g = torch.Generator().manual_seed(2)
            batch = {"input_ids": torch.randint(0, 1000, (32, 128), generator=g),
                     "labels": torch.randint(0, 2, (32,), generator=g)}
            return bert, batch, "BERT 2x256, batch 32x128"
    g = torch.Generator().manual_seed(2)
    batch = {"x": torch.randn(64, 256, generator=g), "y": torch.randn(64, 1, generator=g)}
    return (lambda: net(256)), batch, "MLP 256 wide, batch 64"


def _timed_steps(device: torch.device, make, batch, steps: int, warmup: int, **settings) -> tuple:
    """(seconds per step after ``warmup`` steps, seconds of the warm-up, final parameters)."""
    def wait():
        if device.type == "cuda":
            torch.cuda.synchronize()
    with session(device, **settings) as dev:
        model, opt = ud.prepare(*with_optimizer(make(), "SGD", lr=1e-3))
        inputs = {k: v.to(dev) for k, v in batch.items()}

        def step():
            out = model(**inputs).loss if "labels" in inputs else \
                nn.functional.mse_loss(model(inputs["x"]), inputs["y"])
            ud.backward(out)
            opt.step()
            opt.zero_grad()
        start = time.perf_counter()
        for _ in range(warmup):
            step()
        wait()
        warm = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wait()
        return (time.perf_counter() - start) / steps, warm, [full(p) for p in model.parameters()]


@check
def compile_speedup(device: torch.device) -> Outcome:
    """``init(compile=...)`` against eager: step time of each (figure: eager / compiled), and the same
    weights after the same steps (inductor on a GPU; dynamo's ``eager`` backend in the dry run)."""
    make, batch, what = _compile_subject(device)
    backend = "inductor" if device.type == "cuda" else "eager"
    eager, _, eager_params = _timed_steps(device, make, batch, steps=10, warmup=2)
    compiled, compile_s, compiled_params = _timed_steps(device, make, batch, steps=10, warmup=2, compile=backend)
    error = max(float((a - b).abs().max()) for a, b in zip(eager_params, compiled_params))
    figure = {"speedup": eager / compiled, "eager_ms": 1e3 * eager, "compiled_ms": 1e3 * compiled,
              "first_steps_s": compile_s, "max_param_difference": error}
    return Outcome(error <= 1e-3, figure, {"max_param_difference": 1e-3},
                   f"{what}, backend {backend}, 10 timed steps after 2 (the compile)")


# ---------------------------------------------------------------------- precision and generators
def precision_for(device: torch.device) -> str:
    """fp16 on a GPU; bf16 in the dry run (the facade refuses fp16 without a GPU)."""
    return "fp16" if device.type == "cuda" else "bf16"


def _scaled_run(device: torch.device, mode: str, optimizer: str, options: Dict[str, Any],
                data: Sequence[tuple]) -> tuple:
    """(model, which steps the scaler applied) after training on ``data`` with ``mixed_precision=mode``.
    A step whose gradients overflowed is skipped by the GradScaler, which then halves its scale: that
    is how a skipped step shows (on a GPU the first steps may overflow at the initial scale 2**16)."""
    model, opt = ud.prepare(*with_optimizer(net(), optimizer, **options))
    scaler = getattr(opt, "scaler", None)
    if (scaler is not None) != (mode == "fp16"):
        raise AssertionError(f"mixed_precision={mode!r} prepared an optimizer with scaler {scaler!r}")
    applied = []
    for batch in data:
        before = scaler.get_scale() if scaler is not None else None
        train(model, opt, [batch], ud.device())
        applied.append(scaler is None or scaler.get_scale() >= before)
    return model, applied


@check
def fp16_grad_scaling(device: torch.device) -> Outcome:
    """fp16 with the facade's GradScaler and SGD, Adam, AdamW: the steps it applied stay within 10% of
    the float64 run of the same steps (figure: max |error| / max |weight change| per optimizer); at
    least 4 of 8 applied. The dry run uses bf16 (fp16 needs a GPU): no scaler there."""
    mode = precision_for(device)
    data = batches(8)
    figure: Dict[str, Any] = {}
    skipped: Dict[str, int] = {}
    # Adam's eps is large so that a rounding of a near-zero gradient cannot flip a whole step's sign
    for name, options in (("SGD", {"lr": 0.1}), ("Adam", {"lr": 1e-2, "eps": 0.1}),
                          ("AdamW", {"lr": 1e-2, "eps": 0.1})):
        with session(device, mixed_precision=mode):
            model, applied = _scaled_run(device, mode, name, options, data)
            ref = reference([b for b, ok in zip(data, applied) if ok], name, **options)
            change = max(float((r - full(p0)).abs().max()) for r, p0 in zip(ref, net().parameters()))
            figure[name] = max_error(model, ref) / change if change else float("inf")
            skipped[name] = applied.count(False)
    passed = all(v <= 0.1 for v in figure.values()) and all(n <= 4 for n in skipped.values())
    return Outcome(passed, figure, 0.1, f"mixed_precision={mode!r}: max |param - float64 reference| / max "
                   f"|reference change|; steps the scaler skipped: {skipped}", extra={"skipped": skipped})


@check
def accelerate_mixed_precision(device: torch.device) -> Outcome:
    """Under the Accelerate backend (one process), fp16 (bf16 in the dry run) trains as under the torch
    backend: after 8 AdamW steps the same weights (figure: max |difference|) and the same steps applied
    (Accelerate's GradScaler, stepped by its optimizer; ``ud.backward`` scales the loss as on every
    backend); a forward outside ``ud.autocast()`` computes in float32 (Accelerate's always-on forward
    autocast is not put on the model), inside in the mode's dtype."""
    from ..session import current

    mode = precision_for(device)
    data = batches(8)
    runs: Dict[str, Any] = {}
    for backend in ("torch", "accelerate"):
        ud.init(backend, mixed_precision=mode)
        try:
            model, opt = ud.prepare(*with_optimizer(net(), "AdamW", lr=1e-2, eps=0.1))
            applied = []
            for batch in data:
                before = current().sync.loss_scale()
                train(model, opt, [batch], ud.device())
                after = current().sync.loss_scale()
                applied.append(before is None or bool(after >= before))
            x = data[0][0].to(ud.device())
            with ud.autocast():
                inside = model(x).dtype
            runs[backend] = ([p.detach().float().cpu() for p in ud.unwrap(model).parameters()], applied,
                             str(model(x).dtype), str(inside), before is not None)
        finally:
            ud.shutdown()
    (torch_params, torch_applied, *_), (params, applied, outside, inside, scaled) = runs["torch"], runs["accelerate"]
    difference = max(float((a - b).abs().max()) for a, b in zip(params, torch_params))
    expected = "torch.float16" if mode == "fp16" else "torch.bfloat16"
    figure = {"max_difference": difference, "applied": applied.count(True), "torch_applied": torch_applied.count(True),
              "outside_autocast": outside, "inside_autocast": inside, "loss_scaled": scaled}
    passed = (difference <= 1e-6 and applied == torch_applied and outside == "torch.float32"
              and inside == expected and scaled == (mode == "fp16"))
    return Outcome(passed, figure, {"max_difference": 1e-6},
                   f"mixed_precision={mode!r}: ud.init('accelerate') against ud.init('torch'), 8 AdamW steps")


@check
def cuda_rng_states(device: torch.device) -> Outcome:
    """``ud.save({"rng": ud.RNG})`` then ``ud.load``: the device's generator draws the same numbers
    again (on a GPU the saved states include CUDA's)."""
    with session(device) as dev, tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rng.pt")
        ud.seed_everything(3)
        ud.save({"rng": ud.RNG}, path)
        first = torch.randn(5, device=dev)
        torch.randn(7, device=dev)
        ud.load(path, {"rng": ud.RNG})
        again = torch.randn(5, device=dev)
        saved = torch.load(path, weights_only=True)["rng"]
        has_cuda = "cuda" in (saved[0] if isinstance(saved, list) else saved)
        equal = torch.equal(first, again)
        passed = equal and has_cuda == (device.type == "cuda")
        return Outcome(passed, {"same_draws": equal, "cuda_states_saved": has_cuda}, None,
                       f"draws on {dev} after ud.load of a saved ud.RNG")


@check
def async_save_from_cuda(device: torch.device) -> Outcome:
    """``ud.save(..., async_save=True)`` of a model on the device: the file holds the weights of the call
    even though the next optimizer step changes them in place while it is written; figure: the time the
    call blocked training against a blocking save of the same state."""
    width = 2048 if device.type == "cuda" else 64  # 6 x 4.2 M parameters (100 MB) on a GPU

    def layers() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(6)])
    with session(device) as dev, tempfile.TemporaryDirectory() as tmp:
        model, opt = ud.prepare(*with_optimizer(layers()))
        x = torch.randn(32, width, generator=torch.Generator().manual_seed(1)).to(dev)

        def step() -> None:
            ud.backward(model(x).square().mean())
            opt.step()
            opt.zero_grad()
        step()
        start = time.perf_counter()
        ud.save({"model": model}, os.path.join(tmp, "blocking.pt"))
        blocking = time.perf_counter() - start
        at_call = [p.detach().double().cpu() for p in model.parameters()]
        start = time.perf_counter()
        ud.save({"model": model}, os.path.join(tmp, "async.pt"), async_save=True)
        blocked = time.perf_counter() - start
        step()  # in place, while the write may still run
        ud.barrier()  # a settling point: the write is done (or its failure raised)
        moved = max(float((p.detach().double().cpu() - q).abs().max()) for p, q in zip(model.parameters(), at_call))
        fresh = layers()
        ud.load(os.path.join(tmp, "async.pt"), {"model": fresh})
        error = max(float((p.detach().double() - q).abs().max()) for p, q in zip(fresh.parameters(), at_call))
        figure = {"max_difference": error, "moved_by_next_step": moved, "blocked_s": blocked,
                  "blocking_save_s": blocking, "blocked_over_blocking": blocked / blocking}
        return Outcome(error == 0.0 and moved > 0, figure, {"max_difference": 0.0},
                       f"{6 * width * (width + 1) / 1e6:.1f} M parameters on {dev}: the file against the weights "
                       "at the call (the next step moved them)")


# ---------------------------------------------------------------------- synchronised BatchNorm, two ranks
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
RANK_TIMEOUT_S = 150.0


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def _bn_data() -> torch.Tensor:
    return torch.randn(8, 3, generator=torch.Generator().manual_seed(4))


def _join(stack: str):
    """(rank, world, gather, reduce_sum, the stack's CUDA class) for ``stack`` ("torch": a gloo group
    from the environment; "horovod": ``hvd.init()`` under horovodrun)."""
    if stack == "horovod":
        import horovod.torch as hvd

        hvd.init()
        return hvd.rank(), hvd.size(), hvd.allgather, lambda t: hvd.allreduce(t, op=hvd.Sum), hvd.SyncBatchNorm
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t)
        return t
    return dist.get_rank(), world, gather, reduce_sum, nn.SyncBatchNorm


def _sync_bn_rank(stack: str, device: torch.device, out: Path) -> None:
    """One of two ranks sharing ``device``: the stack's CUDA SyncBatchNorm (the portable one of
    :mod:`unified_dist.parallel.sync_batchnorm` on a CPU, as the backends choose) on half the batch; rank 0
    writes the largest relative error of outputs, summed gradients and running statistics against
    BatchNorm on the whole batch in float64."""
    from ..parallel import sync_batchnorm

    rank, world, gather, reduce_sum, cuda_class = _join(stack)
    make = sync_batchnorm.sharing(cuda_class) if device.type == "cuda" else \
        sync_batchnorm.portable(gather, reduce_sum, lambda: (rank, world))
    model = sync_batchnorm.convert(_bn_model().to(device), make)
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    out_local = model(_bn_data()[rows].to(device))
    out_local.pow(3).sum().backward()
    ref = _bn_model().double()
    ref_out = ref(_bn_data().double())
    ref_out.pow(3).sum().backward()
    pairs = [(out_local, ref_out[rows])]
    pairs += [(reduce_sum(p.grad), r.grad) for p, r in zip(model.parameters(), ref.parameters())]
    pairs += [(b, r) for b, r in zip(model.buffers(), ref.buffers()) if b.is_floating_point()]
    error = max(float((a.detach().double().cpu() - b.detach()).abs().max() / (1 + b.detach().abs().max()))
                for a, b in pairs)
    if rank == 0:
        kind = type(model[1])
        _write(out / "rank0.json", {"error": error, "class": f"{kind.__module__}.{kind.__name__}"})
    if stack == "torch":  # left to interpreter exit, gloo's threads abort the process now and then (SIGABRT)
        import torch.distributed as dist

        dist.destroy_process_group()


def _two_ranks(stack: str, device: torch.device) -> Outcome:
    """Run :func:`_sync_bn_rank` in two processes (killed after :data:`RANK_TIMEOUT_S`) and judge rank 0's figure."""
    from ..backends.ports import free_port
    from .processes import launcher_path

    with tempfile.TemporaryDirectory(prefix="unified-dist-gpu-check-") as tmp:
        worker = [sys.executable, "-m", "unified_dist.checks.gpu_checks", "--rank-of", stack,
                  "--device", device.type, "--out", tmp]
        path = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        if stack == "horovod":
            commands = [([launcher_path("horovod"), "-np", "2", "-H", "localhost:2", "--gloo", *worker], env)]
        else:
            rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
            commands = [(worker, {**env, **rendezvous, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
        procs = [subprocess.Popen(argv, env=e, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for argv, e in commands]
        try:
            logs = [p.communicate(timeout=RANK_TIMEOUT_S)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        result_path = Path(tmp) / "rank0.json"
        if any(p.returncode for p in procs) or not result_path.exists():
            lines = [line for log in logs for line in log.splitlines() if line.strip()] or ["no output"]
            last = next((line for line in reversed(lines) if "Error" in line), lines[-1])
            raise AssertionError(f"the ranks exited with {[p.returncode for p in procs]}: {last[:300]}")
        result = json.loads(result_path.read_text())
    return Outcome(result["error"] <= 1e-4, result["error"], 1e-4,
                   f"{result['class']} on {device.type}, 2 ranks over gloo vs BatchNorm on the whole batch "
                   "(relative error of outputs, gradients, running stats)")


@check
def torch_sync_batchnorm(device: torch.device) -> Outcome:
    """torch's SyncBatchNorm on CUDA (two ranks on one GPU over gloo) equals BatchNorm on the whole batch."""
    return _two_ranks("torch", device)


@check
def horovod_sync_batchnorm(device: torch.device) -> Outcome:
    """hvd.SyncBatchNorm on CUDA under ``horovodrun -np 2`` equals BatchNorm on the whole batch
    (skipped where Horovod is not installed)."""
    from .processes import installed

    if not installed("horovod"):
        return Outcome(False, None, None, "Horovod or horovodrun is not installed here", skipped=True)
    return _two_ranks("horovod", device)


# ---------------------------------------------------------------------- the worker
def _write(path: Path, record: Dict[str, Any]) -> None:
    """Write ``record`` as JSON atomically (the parent may read it at any moment)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, default=str))
    os.replace(tmp, path)


def run_one(name: str, device: torch.device) -> Dict[str, Any]:
    """The record of check ``name``: its outcome, or its error in one line (a failure of that check only)."""
    start = time.perf_counter()
    try:
        outcome = CHECKS[name](device)
        record = {"status": outcome.status, **asdict(outcome)}
    except Exception as exc:  # noqa: BLE001 - one failing check must not stop the others
        record = {"status": "FAIL", "detail": f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:500],
                  "traceback": traceback.format_exc(limit=-4)}
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rank-of", choices=("torch", "horovod"))
    parser.add_argument("names", nargs="*")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.rank_of:
        _sync_bn_rank(args.rank_of, device, args.out)
        return 0
    unknown = [n for n in args.names if n not in CHECKS]
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    for name in args.names:
        _write(args.out / f"{name}.json", {"status": "running", "started": time.time()})
        _write(args.out / f"{name}.json", run_one(name, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
