"""Images per second of a small CNN trained by a plain ``import horovod.torch as hvd`` script, run as
unified_dist.horovod under torchrun and as real Horovod under horovodrun (issue #40).

The protocol is Horovod's synthetic benchmark's (examples/pytorch/pytorch_synthetic_benchmark.py): one
fixed batch of random images, SGD wrapped in ``hvd.DistributedOptimizer``, parameters and optimizer
state broadcast from rank 0, warm-up batches, then ``--iters`` timed iterations of ``--batches-per-iter``
steps each; images/s per process is the mean over iterations, the total is that times ``hvd.size()``.
This file is our own, written for this repository (torchvision is not installed: the model is a small
CNN defined here, on 32x32 images, so a run takes seconds on CPU).

Worker (started by a launcher)::

    python bench/horovod/hvd_synthetic.py --out FILE --expect shim|real

Driver (one invocation, every side of ``SIDES`` in rotating order, ``bench/horovod/results/hvd_synthetic.json``)::

    OMP_NUM_THREADS=1 python bench/horovod/hvd_synthetic.py --drive [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "horovod" / "results"
IMPLEMENTATION = {"shim": "unified_dist.horovod", "real": "horovod.torch"}
"""What ``hvd.__name__`` is for each side: the run fails if the launched script got the other one."""
SIDES = ("shim", "real", "real_cycle")
"""unified_dist.horovod under torchrun; real Horovod under horovodrun with its defaults (the headline
ratio's denominator); real Horovod with ``--cycle-time-ms`` set to the cycle unified_dist's own Horovod
backend gives CPU jobs (``CPU_CYCLE_MS``), to show how much of the gap is that one setting."""


def model_and_batch(batch_size: int, classes: int = 10):
    """A small CNN (two conv blocks, one linear layer) and one fixed batch of 3x32x32 random images."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, classes))
    data = torch.randn(batch_size, 3, 32, 32)
    target = torch.randint(0, classes, (batch_size,))
    return model, data, target


def worker(args) -> None:
    """Train under the launcher that started this process; rank 0 writes ``args.out``."""
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    hvd.init()
    if hvd.__name__ != IMPLEMENTATION[args.expect]:
        raise SystemExit(f"hvd_synthetic: expected {IMPLEMENTATION[args.expect]}, got {hvd.__name__} "
                         f"({getattr(hvd, '__file__', '?')}): check PYTHONPATH")
    model, data, target = model_and_batch(args.batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         op=hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    per_iter = []
    for _ in range(args.iters):
        start = time.perf_counter()
        for _ in range(args.batches_per_iter):
            step()
        per_iter.append(args.batch_size * args.batches_per_iter / (time.perf_counter() - start))
    _report(hvd, model, per_iter, args)


def _report(hvd, model, per_iter: list, args) -> None:
    """Gather every rank's mean images/s; check the ranks' weights agree (training was synchronized)."""
    import torch

    means = hvd.allgather(torch.tensor([statistics.mean(per_iter)], dtype=torch.float64)).tolist()
    flat = torch.cat([p.detach().reshape(1, -1) for p in model.parameters()], dim=1)
    every = hvd.allgather(flat)  # one row per rank
    spread = (every.max(dim=0).values - every.min(dim=0).values).max().item()
    if spread > 1e-5:
        raise SystemExit(f"hvd_synthetic: ranks' weights differ by {spread:g} after training")
    if hvd.rank() == 0:
        record = {"implementation": hvd.__name__, "size": hvd.size(), "images_per_s_per_iter_rank0": per_iter,
                  "images_per_s_per_process": means, "images_per_s_total": sum(means),
                  "weights_max_spread": spread}
        Path(args.out).write_text(json.dumps(record, indent=1))


def launch_argv(side: str, out: Path, args) -> tuple:
    """``(argv, env)`` of one run: torchrun x 2 with the redirect for ``shim``, horovodrun x 2 --gloo
    for ``real`` and ``real_cycle`` (its gloo rendezvous takes a free port of its own); one thread per process."""
    from unified_dist.backends.buckets import CPU_CYCLE_MS
    from unified_dist.horovod import redirect
    from unified_dist.testing.launchers import BIN, child_env, free_port

    script = [str(Path(__file__).resolve()), "--out", str(out), "--expect", side.split("_")[0], "--batch-size",
              str(args.batch_size), "--warmup", str(args.warmup), "--iters", str(args.iters),
              "--batches-per-iter", str(args.batches_per_iter)]
    env = child_env()
    if side == "shim":
        env["PYTHONPATH"] = redirect.pythonpath(env)
        return [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port()), *script], env
    cycle = ["--cycle-time-ms", str(CPU_CYCLE_MS)] if side == "real_cycle" else []
    return [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", *cycle, "python", *script], env


def _shown(argv: list, env) -> str:
    """``argv`` as a reader would type it: paths under the checkout relative to it, the launcher by
    name, and the ``PYTHONPATH`` that makes ``horovod.torch`` the shim where ``env`` is given."""
    words = [Path(argv[0]).name] + [os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a for a in argv[1:]]
    if env is not None:
        words.insert(0, "PYTHONPATH=" + ":".join(os.path.relpath(p, ROOT) if p.startswith(str(ROOT)) else p
                                                  for p in env["PYTHONPATH"].split(os.pathsep)))
    return " ".join(words)


def drive(args) -> dict:
    """``args.rounds`` rounds, each running every side of :data:`SIDES` (the order rotates by round)."""
    import provenance
    from unified_dist.testing.launchers import run

    record = provenance.start()
    record["settings"] = {k: getattr(args, k) for k in ("batch_size", "warmup", "iters", "batches_per_iter",
                                                        "rounds")}
    record["settings"]["omp_num_threads"] = 1
    runs = {side: [] for side in SIDES}
    commands = {}
    out = Path(tempfile.mkdtemp(prefix="hvd_synthetic_")) / "run.json"
    for r in range(args.rounds):
        for side in SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]:
            argv, env = launch_argv(side, out, args)
            commands[side] = _shown(argv, env if side == "shim" else None)
            out.unlink(missing_ok=True)
            started = time.perf_counter()
            run(argv, args.timeout, env=env, cwd=ROOT).check()
            one = json.loads(out.read_text())
            one.update(round=r, wall_s=time.perf_counter() - started, load_after=os.getloadavg())
            runs[side].append(one)
            print(f"round {r} {side}: {one['images_per_s_total']:.1f} images/s total", flush=True)
    out.unlink(missing_ok=True)
    out.parent.rmdir()
    median = {side: statistics.median(x["images_per_s_total"] for x in runs[side]) for side in runs}
    record.update(commands=commands, runs=runs, summary={
        "shim_images_per_s": median["shim"], "real_images_per_s": median["real"],
        "real_cycle_images_per_s": median["real_cycle"], "ratio": median["shim"] / median["real"],
        "ratio_vs_real_cycle": median["shim"] / median["real_cycle"]})
    return provenance.finish(record)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drive", action="store_true", help="run both sides, alternating; write --out")
    p.add_argument("--out", default=None)
    p.add_argument("--expect", choices=sorted(IMPLEMENTATION), default="real")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--batches-per-iter", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args(argv)
    if not args.drive:
        if not args.out:
            p.error("a worker needs --out FILE (or run the comparison with --drive)")
        return worker(args)
    sys.path[:0] = [str(ROOT / "bench" / "shared"), str(ROOT)]
    record = drive(args)
    out = Path(args.out or RESULTS / "hvd_synthetic.json")
    out.write_text(json.dumps(record, indent=1) + "\n")
    s = record["summary"]
    print(f"unified_dist.horovod {s['shim_images_per_s']:.1f} / real Horovod {s['real_images_per_s']:.1f} "
          f"images/s = {s['ratio']:.3f} (with a {s['real_cycle_images_per_s']:.1f} images/s Horovod at the CPU cycle: "
          f"{s['ratio_vs_real_cycle']:.3f}); wrote {out}")


if __name__ == "__main__":
    main()
