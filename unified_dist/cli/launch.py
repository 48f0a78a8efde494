"""``unified-dist launch``: one command line for torchrun, accelerate launch, horovodrun and deepspeed.

:func:`build` turns a :class:`Plan` into the exact native command a user would type on this
machine; :func:`run` prints it and replaces this process with the launcher, so the launcher
owns the terminal, receives Ctrl-C, and its exit status is the command's. The launched script
sees what the native launcher gives it, plus the ``UNIFIED_DIST_*`` variable of every setting
flag given (``--mixed-precision``, ``--sharding``, ...; one per setting of
:data:`unified_dist.settings.TABLE` that has a variable), except where the launcher carries the
setting itself (``accelerate launch --mixed_precision``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import replace
from typing import Any, Dict, FrozenSet, List, Mapping, NoReturn, Optional, Tuple

from .. import settings
from ..backends.ports import DEFAULT_MASTER_PORT
from ..backends.precision import Precision
from ..errors import PrecisionError, SettingError
from ..registry import LAUNCHED, SPECS, launcher_path
from .commands import Command, Plan, environment, search_path
from .errors import UsageError

BACKENDS: Tuple[str, ...] = LAUNCHED
"""Backends that have a multi-process launcher (``single`` is plain ``python script.py``)."""

LAUNCHER_OF: Dict[str, str] = {name: SPECS[name].launcher for name in BACKENDS}
"""Each backend's launcher command (from :data:`unified_dist.registry.SPECS`)."""

INSTALL_FIX: Dict[str, str] = {name: SPECS[name].install_fix for name in BACKENDS}
"""How to get each backend's library and launcher, for error messages and ``unified-dist env``."""


NATIVE: Dict[str, FrozenSet[str]] = {"accelerate": frozenset({"mixed_precision", "compile", "compile_mode"})}
"""The settings a backend's launcher carries with flags of its own (``accelerate launch --mixed_precision``)
instead of the script's ``UNIFIED_DIST_*`` variable."""


# ---------------------------------------------------------------------- building
def build(plan: Plan, cuda: bool = False, environ: Mapping[str, str] = os.environ) -> Command:
    """The native command for ``plan`` on a machine with (``cuda``) or without a GPU.

    Pure apart from reading ``environ`` for the default mixed precision; raises
    :class:`UsageError` for a plan no launcher can honour (:func:`check_plan`).
    """
    check_plan(plan)
    command = SPECS[plan.backend].load("command")(plan, cuda, environ)
    given = {name: value for name, value in plan.settings.items() if name not in command.native}
    return replace(command, env={**command.env, **settings.flag_environment(given)})


def check_plan(plan: Plan) -> None:
    """Raise :class:`UsageError` for a plan no launcher can honour (no torch needed, except to ask
    whether the backend can shard)."""
    if plan.backend not in BACKENDS:
        raise UsageError(f"unknown backend {plan.backend!r}; choose one of {', '.join(BACKENDS)}")
    if plan.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {plan.nproc}")
    if plan.nnodes < 1:
        raise UsageError(f"--nnodes must be at least 1, got {plan.nnodes}")
    if not 0 <= plan.node_rank < plan.nnodes:
        raise UsageError(f"--node-rank must be in 0..{plan.nnodes - 1} for --nnodes {plan.nnodes}, "
                         f"got {plan.node_rank}")
    for name, value in plan.settings.items():
        if name not in settings.FLAGS:
            raise UsageError(f"unified-dist launch has no setting {name!r}; its flags: "
                             + ", ".join(settings.flag_name(n) for n in settings.FLAGS))
        if value is None:
            continue
        try:
            settings.TABLE[name].from_code(value)
        except (SettingError, PrecisionError) as exc:
            raise UsageError(f"{settings.flag_name(name)}: {exc}") from None
    if not SPECS[plan.backend].sharding:
        for flag, value, off in (("--sharding", plan.setting("sharding"), "no"), ("--tp", plan.setting("tp"), 1),
                                 ("--dp-replicate", plan.setting("dp_replicate"), 1)):
            if value not in (None, off):
                raise UsageError(f"{flag} {value}: {plan.backend} has no sharding or tensor parallelism; "
                                 "use --backend torch or accelerate")


def check_precision(plan: Plan, cuda: bool) -> None:
    """Raise :class:`UsageError` when this machine cannot run ``--mixed-precision`` (fp16 without a
    CUDA GPU), as ``ud.init`` would refuse it in every process."""
    if plan.setting("mixed_precision"):
        try:
            Precision(plan.setting("mixed_precision")).check_device(cuda, spelling="--mixed-precision {}")
        except PrecisionError as exc:
            raise UsageError(str(exc)) from None


def _multi_node_address(plan: Plan) -> Tuple[str, int]:
    if plan.hosts:
        raise UsageError(f"--hosts is horovod's; {plan.backend} runs the same command on every node with "
                         "--nnodes, its own --node-rank and --master-addr")
    if not plan.master_addr:
        raise UsageError(f"--nnodes {plan.nnodes} needs --master-addr (the address of the node with "
                         "--node-rank 0); run the same command on every node with its own --node-rank")
    return plan.master_addr, plan.master_port or DEFAULT_MASTER_PORT


def _socket_env(plan: Plan, cuda: bool) -> Dict[str, str]:
    if not plan.network_interface:
        return {}
    env = {"GLOO_SOCKET_IFNAME": plan.network_interface}
    if cuda:
        env["NCCL_SOCKET_IFNAME"] = plan.network_interface
    return env


def torchrun_command(plan: Plan, cuda: bool, environ: Mapping[str, str]) -> Command:
    """torch's command: ``torchrun --standalone`` on one node, a static rendezvous on several."""
    if plan.nnodes == 1:
        # --standalone picks a free rendezvous port itself, so --master-port is not needed here.
        layout = ["--standalone", "--nproc_per_node", str(plan.nproc)]
    else:
        addr, port = _multi_node_address(plan)
        layout = ["--nnodes", str(plan.nnodes), "--node_rank", str(plan.node_rank),
                  "--nproc_per_node", str(plan.nproc), "--master_addr", addr, "--master_port", str(port)]
    argv = ("torchrun", *layout, plan.script, *plan.script_args)
    return Command(argv, _socket_env(plan, cuda))


def accelerate_command(plan: Plan, cuda: bool, environ: Mapping[str, str]) -> Command:
    """accelerate's command: ``accelerate launch`` with every setting its config file would hold."""
    total = plan.nproc * plan.nnodes
    # --multi_gpu is what starts a real multi-process job, also on a CPU-only machine (then
    # over gloo); without it each process believes it is alone.
    args: List[str] = ["--multi_gpu"] if total > 1 else []
    args += ["--num_processes", str(total), "--num_machines", str(plan.nnodes)]
    if plan.nnodes > 1:
        addr, port = _multi_node_address(plan)
        args += ["--machine_rank", str(plan.node_rank), "--main_process_ip", addr, "--main_process_port", str(port)]
    elif plan.master_port:
        args += ["--main_process_port", str(plan.master_port)]
    mode = plan.setting("mixed_precision") or settings.TABLE["mixed_precision"].from_environment(environ)
    compiler = plan.setting("compile") or settings.TABLE["compile"].from_environment(environ)
    args += ["--mixed_precision", mode, "--dynamo_backend", compiler or "no"]
    compile_mode = plan.setting("compile_mode") or settings.TABLE["compile_mode"].from_environment(environ)
    if compile_mode != "default":
        args += ["--dynamo_mode", compile_mode]
    argv = ("accelerate", "launch", *args, plan.script, *plan.script_args)
    return Command(argv, _socket_env(plan, cuda), native=NATIVE["accelerate"])


def deepspeed_command(plan: Plan, cuda: bool, environ: Mapping[str, str]) -> Command:
    """deepspeed's command: DeepSpeed's own launcher on one node (``--num_gpus`` is its processes per node, on a
    CPU too; ``--no_local_rank``: the script reads ``LOCAL_RANK`` as under torchrun instead of getting a
    ``--local_rank`` argument it may not parse). On several nodes torchrun's static rendezvous with
    ``UNIFIED_DIST_BACKEND=deepspeed`` (DeepSpeed's own multi-node launch goes through pdsh and a hostfile)."""
    if plan.nnodes > 1:
        command = torchrun_command(plan, cuda, environ)
        return replace(command, env={**command.env, settings.BACKEND_ENV: SPECS["deepspeed"].name})
    port = ("--master_port", str(plan.master_port)) if plan.master_port else ()
    argv = ("deepspeed", "--num_gpus", str(plan.nproc), "--no_local_rank", *port, plan.script, *plan.script_args)
    return Command(argv, _socket_env(plan, cuda))


def parse_hosts(text: str, default_slots: int) -> List[Tuple[str, int]]:
    """``"a:2,b"`` -> ``[("a", 2), ("b", default_slots)]``."""
    hosts = []
    for item in text.split(","):
        name, _, slots = item.strip().partition(":")
        if not name:
            raise UsageError(f"--hosts {text!r}: empty host name; write host1:slots,host2:slots")
        try:
            count = int(slots) if slots else default_slots
        except ValueError:
            raise UsageError(f"--hosts {text!r}: slots of {name!r} must be an integer (host:slots)") from None
        if count < 1:
            raise UsageError(f"--hosts {text!r}: {name!r} needs at least 1 slot")
        hosts.append((name, count))
    return hosts


def horovodrun_command(plan: Plan, cuda: bool, environ: Mapping[str, str]) -> Command:
    """horovod's command: ``horovodrun --gloo`` once, on the first host, which reaches the others over ssh."""
    if plan.hosts:
        hosts = parse_hosts(plan.hosts, plan.nproc)
        if plan.nnodes > 1 and plan.nnodes != len(hosts):
            raise UsageError(f"--nnodes {plan.nnodes} but --hosts names {len(hosts)} hosts; "
                             "give one host:slots per node")
    elif plan.nnodes > 1:
        raise UsageError(f"horovod on {plan.nnodes} nodes needs --hosts host1:slots,host2:slots "
                         "(horovodrun runs once, on the first node, and starts the others over ssh)")
    else:
        hosts = [("localhost", plan.nproc)]
    if plan.node_rank != 0:
        raise UsageError("horovodrun is started once, on the first node (--node-rank 0); "
                         "it starts the processes of the other --hosts over ssh")
    args = ["-np", str(sum(slots for _, slots in hosts)),
            "-H", ",".join(f"{name}:{slots}" for name, slots in hosts), "--gloo"]
    if plan.network_interface:
        args += ["--network-interface", plan.network_interface]
    argv = ("horovodrun", *args, _python_name(), plan.script, *plan.script_args)
    return Command(argv)


# ---------------------------------------------------------------------- this machine
def _python_name() -> str:
    """``python`` when that name finds this interpreter (horovodrun starts workers by name), else its path."""
    found = shutil.which("python", path=search_path())
    if found and os.path.realpath(found) == os.path.realpath(sys.executable):
        return "python"
    return sys.executable


def find_launcher(backend: str, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The path of ``backend``'s launcher in this environment, or ``None``."""
    return launcher_path(backend, environ)


def check_machine(plan: Plan, environ: Mapping[str, str] = os.environ) -> None:
    """Raise :class:`UsageError` unless the launcher is installed and the script exists."""
    launcher = LAUNCHER_OF[plan.backend]
    if find_launcher(plan.backend, environ) is None:
        raise UsageError(f"{launcher} (the {plan.backend} launcher) is not installed here; {INSTALL_FIX[plan.backend]}")
    if not os.path.isfile(plan.script):
        raise UsageError(f"script {plan.script!r} does not exist (relative to {os.getcwd()})")


def run(command: Command) -> NoReturn:
    """Print ``+ command`` on stderr and become the launcher (its exit status becomes ours)."""
    print(f"+ {command.line()}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    env = environment(command)
    os.execvpe(command.argv[0], list(command.argv), env)


def with_horovod_api(command: Command, environ: Mapping[str, str] = os.environ) -> Command:
    """``command`` with :mod:`unified_dist.horovod.redirect`'s directory first on ``PYTHONPATH``, so that the
    launched script's ``import horovod.torch`` is :mod:`unified_dist.horovod` (real Horovod under horovodrun)."""
    from ..horovod.redirect import pythonpath

    return replace(command, env={**command.env, "PYTHONPATH": pythonpath(environ)})


ACCELERATE_RUNNER = ("-m", "unified_dist.accelerate")
"""What runs a script through :mod:`unified_dist.accelerate`'s runner: torchrun's and ``accelerate launch``'s own
``-m`` flag, or the interpreter's under horovodrun."""


def with_accelerate_api(command: Command, plan: Plan) -> Command:
    """``command`` running ``plan.script`` through ``python -m unified_dist.accelerate`` (the runner): the
    launcher's world exported before the script runs, Accelerate's ``Accelerator`` and ``PartialState`` joined
    to it, so an unchanged Accelerate, transformers ``Trainer``, TRL or PEFT script trains over every process
    of every launcher (docs/accelerate-migration.md)."""
    argv = list(command.argv)
    at = len(argv) - len(plan.script_args) - 1  # every builder ends with the script, then its arguments
    if argv[at] != plan.script:
        raise AssertionError(f"the script is not where the runner goes in {command.line()!r}")
    return replace(command, argv=(*argv[:at], *ACCELERATE_RUNNER, *argv[at:]))


# ---------------------------------------------------------------------- subcommand
def add_arguments(parser, backend_required: bool = True) -> None:
    """The ``launch`` subcommand's options (``unified-dist plan`` takes the same; there ``--backend``
    may be left out)."""
    # required by launch itself (main), not argparse: --replica-groups implies torch, its only backend
    parser.add_argument("--backend", choices=BACKENDS,
                        help="the backend, started by its launcher: "
                        + ", ".join(f"{name} ({LAUNCHER_OF[name]})" for name in BACKENDS)
                        + (" (required, except with --replica-groups: torch)" if backend_required else ""))
    parser.add_argument("--nproc", type=int, default=1, metavar="N", help="processes per node (default 1)")
    parser.add_argument("--nnodes", type=int, default=1, metavar="M", help="number of nodes (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's rank (torch, accelerate)")
    parser.add_argument("--master-addr", metavar="A", help="address of node 0 (multi-node torch, accelerate)")
    parser.add_argument("--master-port", type=int, metavar="P",
                        help=f"port on node 0 (multi-node torch, accelerate; default {DEFAULT_MASTER_PORT})")
    parser.add_argument("--hosts", metavar="H1:S,H2:S",
                        help="horovod's hosts and slots; run once, on the first host: "
                             "horovodrun reaches the others over ssh")
    parser.add_argument("--network-interface", metavar="NIC",
                        help="network interface (horovodrun --network-interface; "
                             "GLOO_SOCKET_IFNAME for torch/accelerate)")
    for name in settings.FLAGS:
        _add_setting_flag(parser, settings.TABLE[name])
    api = parser.add_mutually_exclusive_group()
    api.add_argument("--horovod-api", action="store_true",
                     help="the script's `import horovod.torch` imports unified_dist.horovod (Horovod's API on any "
                          "backend); under --backend horovod it stays real Horovod (docs/horovod-migration.md)")
    api.add_argument("--accelerate-api", action="store_true",
                     help="run the script through `python -m unified_dist.accelerate`: an unchanged Accelerate, "
                          "transformers Trainer, TRL or PEFT script trains over every process of every backend's "
                          "launcher (docs/accelerate-migration.md)")
    replica = parser.add_argument_group("replica groups (docs/fault-tolerance.md)")
    replica.add_argument("--replica-groups", type=int, metavar="N",
                         help="N replica groups of --nproc processes on this host (torch, implied) with torchft's "
                              "lighthouse: a group that fails is started again and heals from a live one while the "
                              "others train on")
    replica.add_argument("--max-group-restarts", type=int, default=3, metavar="M",
                         help="starts of a failed replica group after its first, per group (default 3)")
    replica.add_argument("--replica-join-timeout", type=float, metavar="SECONDS",
                         help="how long the groups' quorum waits for a group that is alive but has not asked for "
                              "it (hung, or still loading after a restart) before the others step without it "
                              "(default 5; below 60)")
    replica.add_argument("--replica-log-dir", metavar="DIR",
                         help="where --replica-groups writes the lighthouse's log and each group's exit records "
                              "(default: a new folder in the temporary directory, named when the job starts)")
    parser.add_argument("--dry-run", action="store_true", help="print the command on stdout; do not run it")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs="...", help="arguments for the script")


def _add_setting_flag(parser, setting: settings.Setting) -> None:
    """The flag of one setting of the table: its help, its variable, its choices or its type."""
    kind, where = setting.kind, f"sets {setting.variable} for the script"
    carried = [SPECS[name].launcher for name, names in NATIVE.items() if setting.name in names]
    if carried:
        where += f"; {', '.join(carried)} takes its own flag instead"
    options: Dict[str, Any] = {"help": f"{setting.help} ({where})"}
    if isinstance(kind, settings.Switch):
        options["action"] = argparse.BooleanOptionalAction
    elif isinstance(kind, settings.Choice):
        options["choices"] = kind.values
    elif isinstance(kind, settings.Number):
        options.update(type=int if kind.integer else float, metavar=kind.unit.upper().replace("-", "_"))
    parser.add_argument(settings.flag_name(setting.name), dest=setting.name, default=None, **options)


GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
"""The device files a GPU's driver makes (NVIDIA's, ROCm's, WSL 2's): CUDA and HIP reach the GPU through them."""


def gpu_count() -> int:
    """How many GPUs torch sees here (``torch.cuda.device_count()``). Where none of :data:`GPU_DEVICE_FILES` exists
    there is no GPU for torch to see, and torch is not imported to ask (2-3 CPU-seconds of a launcher's start)."""
    if not any(os.path.exists(path) for path in GPU_DEVICE_FILES):
        return 0
    import torch

    return torch.cuda.device_count()


def main(args) -> int:
    """Build, check and print the command; run it unless ``--dry-run``."""
    plan = Plan(backend=_backend(args), script=args.script, script_args=tuple(args.script_args), nproc=args.nproc,
                nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                master_port=args.master_port, hosts=args.hosts, network_interface=args.network_interface,
                settings={name: getattr(args, name) for name in settings.FLAGS if getattr(args, name) is not None})
    build(plan)  # every usage error (the builders check theirs too), and the machine's, before
    check_machine(plan)  # before any import of torch (seconds): a mistake is answered at once
    cuda = gpu_count() > 0
    check_precision(plan, cuda)
    command = build(plan, cuda=cuda)
    if args.horovod_api:
        command = with_horovod_api(command)
    if args.accelerate_api:
        command = with_accelerate_api(command, plan)
    groups = getattr(args, "replica_groups", None)
    if groups is not None:
        return _run_replica_groups(args, plan, command, groups)
    if args.dry_run:
        print(command.line())
        return 0
    run(command)


def _backend(args) -> str:
    """``--backend``; with ``--replica-groups`` torch, the only backend they run (another is refused)."""
    groups = getattr(args, "replica_groups", None)
    if groups is not None and args.backend in (None, "torch"):
        return "torch"
    if groups is not None:
        raise UsageError(f"--replica-groups runs the torch backend's groups (torchft cannot make {args.backend} "
                         f"fault tolerant): leave out --backend {args.backend}")
    if args.backend is None:
        raise UsageError(f"--backend is required: one of {', '.join(BACKENDS)}")
    return args.backend


def _run_replica_groups(args, plan: Plan, command: Command, groups: int) -> int:
    from . import replicas

    if args.accelerate_api or args.horovod_api:
        raise UsageError("--replica-groups runs the torch backend's groups (torchft cannot make Accelerate or "
                         "Horovod fault tolerant): leave out --accelerate-api/--horovod-api")
    if groups < 1 or plan.nnodes != 1:
        raise UsageError(f"--replica-groups {groups} --nnodes {plan.nnodes}: one host, at least 1 group; on several "
                         "hosts start one group per command against one lighthouse (docs/fault-tolerance.md)")
    if args.max_group_restarts < 0:
        raise UsageError(f"--max-group-restarts must be at least 0, got {args.max_group_restarts}")
    join_ms = replicas.join_timeout_ms(args.replica_join_timeout)
    gpus = gpu_count()
    replicas.check_gpus(groups, plan.nproc, gpus)  # groups that would share GPUs: refused, also in a dry run
    if args.dry_run:
        print(replicas.describe(command, groups, join_ms))
        return 0
    return replicas.run(replicas.with_runner(command, plan), groups, args.max_group_restarts, plan.nproc, gpus,
                        args.replica_log_dir, join_ms)
