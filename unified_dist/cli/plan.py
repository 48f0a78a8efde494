"""``unified-dist plan``: what one rank of a job would hold and send, found on this machine before
the job waits in a queue.

``unified-dist plan --nproc G --nnodes N [the layout flags of unified-dist launch] train.py ARGS``
runs ``train.py`` as one simulated rank (``--rank``, default 0) of the ``N x G`` world, in a child
process (:mod:`unified_dist.checks.plan_worker`: torch's fake process group and fake tensors, nothing
allocated at real size), up to and including its first optimizer step, and prints for that rank:
the bytes of parameters, gradients and optimizer state it holds (the local shards FSDP2 and tensor
parallelism give it), the bytes its first forward saves for backward, the collectives of the step by
kind and process group with their bytes, or the error the real job would stop with. ``--json`` prints
the same as one JSON object. The script's own output goes to stderr.

The torch backend (what torchrun, srun and mpirun run) is simulated; the flags that only say how to
reach other machines (``--master-addr``, ``--hosts``, ...) change nothing in a plan.

``--backend deepspeed --zero-stage S`` (or a script's own ``ud.init(backend="deepspeed", zero_stage=S)``) plans
DeepSpeed's ZeRO stage S without running DeepSpeed: the script runs as under the torch backend, unsharded, and
the rank's bytes are derived from its model's parameters and its optimizer's groups and state after the first
step as DeepSpeed 0.19.8 partitions them (:func:`unified_dist.parallel.accounting.zero_rank_bytes`: parameters,
the float32 master copy of the rank's part, the gradients its update reads, the optimizer state, with
DeepSpeed's padding). Float32 training only: mixed precision, offload and a DeepSpeed config file's optimizer
are not modelled (the plan says so, status 1); DeepSpeed's collectives are not listed. What the deepspeed
backend refuses (``--sharding fsdp``, ``--tp``, ``--dp-replicate``, ``--pp``, ...) the plan refuses in one line.

``--pp P`` plans the simulated rank's pipeline stage (which one, and its parameters, gradients and optimizer state
after its first step) and what its schedule holds for backward at its peak (the first microbatch's saved bytes
through this stage, times the microbatches the schedule holds at once), without running the schedule
(:mod:`unified_dist.checks.plan_worker` says how): no collectives under a pipeline.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List

from .. import settings
from ..errors import UnifiedDistError
from . import launch
from .errors import UsageError

FOREIGN_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "HOROVOD_", "ACCELERATE_", "TORCHELASTIC_",
                    "PARALLELISM_CONFIG_", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
"""Variables of other launchers that would make the simulated rank detect another world."""


def add_arguments(parser) -> None:
    """``unified-dist launch``'s options, plus ``--rank`` and ``--json``."""
    launch.add_arguments(parser, backend_required=False)
    parser.add_argument("--rank", type=int, default=0, metavar="R", help="the global rank to simulate (default 0)")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--compare-checkpointing", action="store_true",
                        help="plan a second time with activation checkpointing switched the other way (needs "
                             "--sharding fsdp) and give the saved-for-backward bytes of both")


def plan_of(args) -> launch.Plan:
    """The launch plan the arguments describe (usage errors raised as ``unified-dist launch`` would)."""
    if args.backend not in (None, "torch", "deepspeed"):
        raise UsageError(f"plan simulates the torch backend (torchrun, srun, mpirun) and plans DeepSpeed's ZeRO "
                         f"stages; got --backend {args.backend}: leave --backend out or give torch or deepspeed")
    if args.dry_run or args.horovod_api or args.accelerate_api or args.replica_groups is not None:
        raise UsageError("plan never starts the job: drop --dry-run, --horovod-api, --accelerate-api and "
                         "--replica-groups (plan one replica group: its --nproc)")
    plan = launch.Plan(backend=args.backend or "torch", script=args.script, script_args=tuple(args.script_args),
                       nproc=args.nproc, nnodes=args.nnodes,
                       settings={name: getattr(args, name) for name in settings.FLAGS
                                 if getattr(args, name) is not None})
    launch.check_plan(plan)
    deepspeed_refusal(plan)
    world = plan.nproc * plan.nnodes
    if not 0 <= args.rank < world:
        raise UsageError(f"--rank must be in 0..{world - 1} for a world of {world} ranks, got {args.rank}")
    if not os.path.isfile(plan.script):
        raise UsageError(f"script {plan.script!r} does not exist (relative to {os.getcwd()})")
    return plan


def deepspeed_refusal(plan: launch.Plan) -> None:
    """Raise :class:`UsageError` for DeepSpeed flags without ``--backend deepspeed``, and, with it, for what the
    deepspeed backend refuses (its own one-line reason) or runs without a pipeline (``--pp``)."""
    from ..backends.base import DEEPSPEED_SETTINGS
    from ..backends.deepspeed_backend import refusal
    from ..session import config_from

    if plan.backend != "deepspeed":
        given = [name for name in DEEPSPEED_SETTINGS if plan.setting(name) is not None]
        if given:
            raise UsageError(f"{settings.flag_name(given[0])} is the deepspeed backend's: add --backend deepspeed")
        return
    try:
        config = config_from(dict(plan.settings), {}, cuda=False)
    except UnifiedDistError as exc:
        raise UsageError(f"--backend deepspeed: {exc}") from None
    problem = (f"pp={config.sharding.pp} runs on the torch backend only; DeepSpeed's engine has no pipeline here"
               if config.sharding.pp > 1 else refusal(config))  # ud.init's order: the pipeline's refusal first
    if problem:
        raise UsageError(f"--backend deepspeed: {problem}")


def environment(plan: launch.Plan, rank: int, base=os.environ) -> Dict[str, str]:
    """The simulated rank's variables: torchrun's for ``rank`` of ``nnodes x nproc``, the
    ``UNIFIED_DIST_*`` variable of each setting flag, no visible GPU, and this package first on ``PYTHONPATH``."""
    env = {k: v for k, v in base.items() if not k.startswith(FOREIGN_PREFIXES)}
    package_root = str(Path(__file__).resolve().parents[2])
    env.update(settings.flag_environment(plan.settings))
    if plan.backend != "torch":
        env[settings.BACKEND_ENV] = plan.backend
    # the simulated rank computes on the CPU: its shards, activations and messages have the same sizes
    # there, and fake parameters cannot move to a GPU
    env.update(CUDA_VISIBLE_DEVICES="", RANK=str(rank), WORLD_SIZE=str(plan.nproc * plan.nnodes),
               LOCAL_RANK=str(rank % plan.nproc), LOCAL_WORLD_SIZE=str(plan.nproc), GROUP_RANK=str(rank // plan.nproc),
               PYTHONPATH=os.pathsep.join([package_root, *filter(None, [base.get("PYTHONPATH")])]))
    return env


def simulate(plan: launch.Plan, rank: int) -> Dict[str, Any]:
    """The report of :mod:`unified_dist.checks.plan_worker` for ``rank`` (the script's output on stderr)."""
    with tempfile.TemporaryDirectory(prefix="ud-plan-") as tmp:
        out = os.path.join(tmp, "plan.json")
        command = [sys.executable, "-m", "unified_dist.checks.plan_worker", out, plan.script, *plan.script_args]
        done = subprocess.run(command, env=environment(plan, rank), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace")
        sys.stderr.write(done.stdout)
        if not os.path.exists(out):
            raise UsageError(f"the simulated rank died (exit status {done.returncode}) before writing its plan; "
                             "its output is above")
        with open(out) as f:
            report = json.load(f)
    report.update(nproc=plan.nproc, nnodes=plan.nnodes, settings=dict(plan.settings))
    return report


def size(n: float) -> str:
    """Bytes in binary units: ``1.50 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def render(report: Dict[str, Any]) -> List[str]:
    """The plan as lines for a person."""
    backend = report.get("backend") or report.get("settings", {}).get("backend") or "torch"
    head = (f"plan: rank {report['rank']} of {report['world']} ({report['nnodes']} node(s) x {report['nproc']}), "
            f"{backend} backend")
    if report["error"]:
        return [head, f"error: {report['error']['type']}: {report['error']['message']}"]
    layout, held, saved = report["layout"], report["bytes"], report["saved_for_backward"]
    zero = report.get("zero_stage")
    pipeline = report.get("pipeline")
    what = (f"DeepSpeed ZeRO stage {zero} over {report['world']} ranks" if zero is not None else
            (f"pp={layout['pp']} x " if layout.get("pp", 1) > 1 else "")
            + f"dp_replicate={layout['dp_replicate']} x dp_shard={layout['dp_shard']} x "
            f"tp={layout['tp']}{' (DDP)' if report['ddp'] else ''}")
    model = "this rank's stage" if pipeline else "model"
    lines = [head, f"layout: {what}; {model}: {report['model_parameters']:,} parameters"]
    if pipeline:
        lines.append(f"pipeline: stage {pipeline['stage']} of {pipeline['stages']} ({pipeline['schedule']}, "
                     f"{pipeline['microbatches']} microbatches); the schedule is not run: the bytes are the stage's")
    lines.append("bytes this rank holds after the first optimizer step:" if zero is None else
                 "bytes this rank holds at its first optimizer step (derived, not run: DeepSpeed 0.19.8, float32):")
    rows = (("parameters", "params"), ("master copies", "master"), ("gradients", "grads"),
            ("optimizer state", "optimizer"), ("total", "total"))
    lines += [f"  {name:<16}{size(held[key]):>12}" for name, key in rows if key in held]
    ac = "on" if report["activation_checkpointing"] else "off"
    if pipeline and saved:
        each = size(saved["microbatch_bytes"] - saved["batch_bytes"])
        kept = saved["kept_between_steps"]
        inference = f" + {size(kept)} torch's shape inference keeps" if kept else ""
        lines.append(f"saved for backward at the schedule's peak (activation checkpointing {ac}): "
                     f"{size(saved['bytes'])} = {saved['microbatches_held']} microbatch(es) of "
                     f"{saved['microbatch_rows']} rows in flight x {each} + the batch's own "
                     f"{size(saved['batch_bytes'])}{inference}")
    else:
        lines.append(f"saved for backward by the first micro-batch (activation checkpointing {ac}): "
                     + (size(saved["bytes"]) if saved else "not seen (no forward of a prepared model)"))
    if "saved_for_backward_other" in report:
        other = report["saved_for_backward_other"]
        lines.append(f"  with activation checkpointing {'off' if ac == 'on' else 'on'}: "
                     + (size(other["bytes"]) if other else "the job would fail (plan it to see why)"))
    if zero is not None or pipeline:
        lines.append("collectives: not planned " + ("under the deepspeed backend (DeepSpeed's own buckets)"
                                                    if zero is not None else "under a pipeline (its schedule)"))
    else:
        lines.append("collectives of the first optimizer step (kind, process group, calls, bytes):")
    for row in report["collectives"]:
        calls = "derived" if row.get("derived") else f"{row['calls']} calls"
        lines.append(f"  {row['kind']:<15}{row['group']:<22}{calls:>12}{size(row['bytes']):>12}")
    lines.append(f"planned in {report['seconds']:.1f} s, {size(report['peak_rss_bytes'])} peak memory")
    return lines


def with_other_checkpointing(plan: launch.Plan, report: Dict[str, Any]) -> Dict[str, Any]:
    """``report`` plus ``saved_for_backward_other``: the first micro-batch's saved bytes with activation
    checkpointing switched the other way (a second simulation), ``None`` where that run failed."""
    other = not report["activation_checkpointing"]
    again = simulate(replace(plan, settings={**plan.settings, "activation_checkpointing": other}), report["rank"])
    if not again["error"] and again["activation_checkpointing"] != other:
        raise UsageError("--compare-checkpointing: the script sets activation_checkpointing in its own ud.init, "
                         "which the flag cannot change; plan it twice with the script's setting changed")
    saved = None if again["error"] else again["saved_for_backward"]
    return {**report, "saved_for_backward_other": saved}


def main(args) -> int:
    """Simulate the rank and print its plan; exit status 1 when the job would stop with an error."""
    plan = plan_of(args)
    if args.compare_checkpointing and plan.setting("sharding") != "fsdp":
        raise UsageError("--compare-checkpointing needs --sharding fsdp (activation checkpointing applies to the "
                         "blocks FSDP2 shards)")
    report = simulate(plan, args.rank)
    if args.compare_checkpointing and not report["error"]:
        report = with_other_checkpointing(plan, report)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print("\n".join(render(report)))
    return 1 if report["error"] else 0
