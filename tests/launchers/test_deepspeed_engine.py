"""The deepspeed backend (issue 59) under real launchers, 2 processes each: its physics and its selectors.

One torchrun launch (``PHYSICS``) trains the tiny model of tests/launchers/workers/deepspeed_worker.py through
the facade's loop for ZeRO stages 0-3 x (SGD with momentum, AdamW) x gradient accumulation 1 and 2
(``ud.init(backend="deepspeed", zero_stage=S, gradient_accumulation_steps=K)``, one session after another in
the same processes), ZeRO 1-3 with the optimizer (and ZeRO-3's parameters) offloaded, then the same loop on the
torch backend (DDP). 2 ranks x batch 4 must give the weights of
1 process x batch 8 computed here with plain torch in float64 (not through the library), and the torch
backend's numbers. The selector launches run one case each, with the backend and stage left to the launcher
and the environment: ``UNIFIED_DIST_BACKEND=deepspeed`` under mpirun (stage from ``UNIFIED_DIST_ZERO_STAGE``),
``accelerate launch --use_deepspeed --deepspeed_config_file`` with a Trainer-style file of stage 3 (which
trained plain DDP without a word before this backend) and Accelerate's offload and clipping flags, and
``unified-dist launch --backend deepspeed --zero-stage 3``
(DeepSpeed's own launcher). The mpirun
selector launch then runs, in the same processes, the portable checkpoints' reshard chain (DDP -> ZeRO-1 -> ZeRO-2
-> ZeRO-3 -> FSDP2, then one process in the test itself) and a plain DeepSpeed script's ``engine.save_checkpoint``.
Two more launches run one case of ``ud.init(backend="deepspeed", zero_stage=S)`` in code where another stack's
launcher started the processes: horovodrun (ZeRO-2) and srun (a one-node SLURM, ZeRO-3).

Why float32 and a derived bound: DeepSpeed refuses float64 parameters (stage 0: ``attempting to reduce an
unsupported grad type: torch.float64``; ZeRO keeps float32 master weights), so the launched runs are float32
and the reference float64. :func:`bound` derives the worst rounding from the reference's own magnitudes.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

from unified_dist.backends.deepspeed_backend import SHARED_MEMORY, shared_buffer
from unified_dist.testing.launchers import BIN, ROOT, Result, child_env, command, free_port, run, unavailable

sys.path.insert(0, str(ROOT / "tests" / "launchers" / "workers"))
import deepspeed_worker as worker  # noqa: E402  (the model, data and cases; the training runs in the launches)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = "tests/launchers/workers/deepspeed_worker.py"
TIMEOUT = 240  # the physics launch takes 65 s on 2 cores (20 engines); a selector launch 20-30 s
U = 2.0 ** -24  # float32's unit roundoff
N_PARAMS = 4 * 3 + 3 + 3 * 2 + 2  # the worker's model: Linear(4, 3), Tanh, Linear(3, 2)


def launch_command(name: str, out: Path) -> list:
    args = ["--out", str(out)]
    if name == "physics":
        return command("torchrun", WORKER, args)
    if name in CODE_STAGE:  # ud.init(backend="deepspeed", zero_stage=S) in code, under another stack's launcher
        return command(name, WORKER, [*args, "--stage", str(CODE_STAGE[name])])
    args.append("--detected")
    if name == "variable":  # then, in the same processes, the reshard chain and a plain DeepSpeed checkpoint
        return command("mpirun", WORKER, [*args, "--checkpoints"])
    if name == "accelerate":  # what a user types: Accelerate's DeepSpeed flags and a config file (on a CPU, no --cpu)
        config = out.parent / "accelerate_deepspeed_config.json"
        config.write_text(json.dumps(ACCELERATE_CONFIG))
        return command("accelerate-deepspeed", WORKER, args,
                       launcher_flags=["--deepspeed_config_file", str(config), *ACCELERATE_WORDS])
    if name == "unified-dist":
        return [str(BIN / "unified-dist"), "launch", "--backend", "deepspeed", "--nproc", "2", "--zero-stage", "3",
                "--master-port", str(free_port()), WORKER, *args]
    raise ValueError(name)


ENV = {"physics": {}, "variable": {"UNIFIED_DIST_BACKEND": "deepspeed", "UNIFIED_DIST_ZERO_STAGE": "1"},
       "accelerate": {}, "unified-dist": {}, "horovodrun": {}, "srun": {}}
ACCELERATE_CONFIG = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
                     "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
"""The config file the accelerate launch names (``--deepspeed_config_file``), as a Trainer user writes one: its stage
is not the one ``--use_deepspeed`` gives without a file (2), so the stage the engine runs at says the file was read;
what it leaves to ``"auto"`` comes from the settings."""
ACCELERATE_WORDS = ["--offload_optimizer_device", "cpu", "--offload_param_device", "cpu",
                    "--gradient_clipping", str(worker.CLIP), "--zero3_init_flag", "true"]
"""Accelerate's other DeepSpeed words on that command line, as a user of ZeRO-3 with offload types them: its file leaves
``gradient_clipping`` to ``"auto"``, and says nothing of offload. The engine must offload both and clip each step's
gradients to ``worker.CLIP`` (below every step's norm here) inside its step, though the loop never clips; each
process says once that it does not build the model inside ``deepspeed.zero.Init``."""
STAGE = {"variable": 1, "accelerate": 3, "unified-dist": 3}
LAUNCHER = {"variable": "mpirun", "accelerate": "accelerate", "unified-dist": "deepspeed"}
CODE_STAGE = {"horovodrun": 2, "srun": 3}
"""The launches of ``ud.init(backend="deepspeed", zero_stage=S)`` under another stack's launcher, and their S."""
LAUNCHER_RANK = {"mpirun": "OMPI_COMM_WORLD_RANK", "horovodrun": "HOROVOD_RANK", "srun": "SLURM_PROCID"}


class Launches:
    """Each launch once per module, by the first test that needs it."""

    def __init__(self, root: Path):
        self.root = root
        self._done: Dict[str, Tuple[Result, Dict[int, dict]]] = {}
        self.commands: Dict[str, list] = {}

    def get(self, name: str, cluster: Dict[str, str] = None) -> Tuple[Result, Dict[int, dict]]:
        """``cluster``: the environment srun needs (the ``slurm_cluster`` fixture's)."""
        if name not in self._done:
            if name == "variable" and shutil.which("mpirun") is None:
                unavailable("no mpirun here (Debian: apt-get install openmpi-bin)")
            out = self.root / name
            self.commands[name] = launch_command(name, out)
            result = run(self.commands[name], TIMEOUT, child_env({**ENV[name], **(cluster or {})}))
            files = {r: out / f"rank{r}.json" for r in range(2)}
            self._done[name] = (result, {r: json.loads(p.read_text()) for r, p in files.items() if p.exists()})
        return self._done[name]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory.mktemp("deepspeed"))


def reference(opt_name: str, k: int, clip: float = math.inf, norms: list = None
              ) -> Tuple[Dict[str, torch.Tensor], float, float, float]:
    """1 process x batch 8 (2 ranks x 4) in float64, plain torch: the final weights, and the largest
    gradient entry G, the smallest |gradient entry| g_min and the largest |weight| W of the run (for :func:`bound`).
    ``clip``: torch's ``clip_grad_norm_`` before each step, its norms appended to ``norms``."""
    x, y = (t.double() for t in worker.data())
    net = worker.model().double()
    opt = worker.optimizer(opt_name, net.parameters())
    batch = 2 * worker.BATCH
    big, small = 0.0, math.inf
    for start in range(0, worker.ROWS, batch * k):
        for j in range(k):
            rows = slice(start + j * batch, start + (j + 1) * batch)
            (torch.nn.functional.mse_loss(net(x[rows]), y[rows]) / k).backward()
        grads = torch.cat([p.grad.flatten() for p in net.parameters()]).abs()
        big, small = max(big, grads.max().item()), min(small, grads.min().item())
        if clip < math.inf:
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
    weights = {n: p.detach().flatten() for n, p in net.named_parameters()}
    return weights, big, small, max(p.abs().max().item() for p in net.parameters())


def bound(opt_name: str, k: int, G: float, g_min: float, W: float) -> float:
    """The largest float32 rounding error of the final weights against the float64 reference.

    A gradient entry is a sum over the batch of products through two layers (dot products of length <= 4,
    tanh, a batch sum of 8 rows): its float32 error is below 64 u G (u = 2**-24, G the largest gradient entry;
    64 covers the accumulated roundings of those <= 16 chained operations with a factor 4 to spare). The weights
    themselves are rounded once per step and operation (4 u W). Over S steps:

    - SGD (lr 0.1, momentum 0.9): each gradient error reaches the weights through lr times the momentum's
      geometric sum 1 / (1 - 0.9) = 10: S (lr 10 * 64 u G + 4 u W).
    - AdamW (lr 0.01, betas 0.9, 0.999): its update m/sqrt(v) is at most (1 - b1) / sqrt(1 - b2) = 3.16 in size
      (Kingma and Ba, 2.1) and moves by 1.5 times the relative error of the gradient it normalises (m by it,
      sqrt(v) by half of it), at worst that of the smallest entry, 64 u G / g_min: S (lr 3.16 * 1.5 * 64 u G /
      g_min + 4 u W).
    """
    steps = worker.ROWS // (2 * worker.BATCH * k)
    if opt_name == "sgd":
        return steps * (0.1 * 10 * 64 * U * G + 4 * U * W)
    return steps * (0.01 * 3.16 * 1.5 * 64 * U * G / g_min + 4 * U * W)


def max_difference(a: Dict[str, list], b: Dict[str, torch.Tensor]) -> float:
    return max((torch.tensor(a[n], dtype=torch.float64) - torch.as_tensor(b[n], dtype=torch.float64)).abs().max().item()
               for n in b)


def finished(launches: Launches, name: str, cluster: Dict[str, str] = None) -> Dict[int, dict]:
    result, ranks = launches.get(name, cluster)
    result.check()
    assert sorted(ranks) == [0, 1], result.output[-3000:]
    return ranks


PHYSICS_CASES = [(stage, opt, k) for stage in worker.STAGES for opt in worker.OPTIMIZERS for k in worker.ACCUMULATIONS]


@pytest.mark.parametrize("stage, opt_name, k", PHYSICS_CASES)
def test_zero_stage_gives_one_process_on_the_global_batch(launches, stage, opt_name, k):
    ranks = finished(launches, "physics")
    case = ranks[0][worker.case_name("deepspeed", stage, opt_name, k)]
    assert (case["backend"], case["launcher"], case["world_size"], case["stage"], case["inner"]) == (
        "deepspeed", "torchrun", 2, stage, "Sequential")
    assert case["steps"] == worker.ROWS // (2 * worker.BATCH * k)
    weights, G, g_min, W = reference(opt_name, k)
    assert max_difference(case["weights"], weights) <= bound(opt_name, k, G, g_min, W)
    other = ranks[1][worker.case_name("deepspeed", stage, opt_name, k)]["weights"]
    assert other == case["weights"]  # both ranks hold the same full weights


@pytest.mark.parametrize("stage, opt_name, k", PHYSICS_CASES)
def test_zero_stage_gives_the_torch_backends_numbers(launches, stage, opt_name, k):
    """The same loop on the torch backend (DDP, float32): both are within the bound of the same float64 reference,
    so they are within twice the bound of each other."""
    ranks = finished(launches, "physics")
    ds = ranks[0][worker.case_name("deepspeed", stage, opt_name, k)]
    ddp = ranks[0][worker.case_name("torch", 0, opt_name, k)]
    assert (ddp["backend"], ddp["stage"]) == ("torch", None)
    _, G, g_min, W = reference(opt_name, k)
    ddp_weights = {n: torch.tensor(v, dtype=torch.float64) for n, v in ddp["weights"].items()}
    assert max_difference(ds["weights"], ddp_weights) <= 2 * bound(opt_name, k, G, g_min, W)


@pytest.mark.parametrize("stage", worker.STAGES)
def test_clip_grad_norm_means_torchs_clip_under_every_stage(launches, stage):
    """``ud.clip_grad_norm_(model.parameters(), 0.2)`` before each SGD step: the norms it returns are those of the
    global batch's gradients, and the weights those of torch's clip_grad_norm_ in one process. Clipping scales each
    step's gradient by 0.2 / norm, so the SGD bound holds with G (the unclipped largest entry) unchanged."""
    ranks = finished(launches, "physics")
    case = ranks[0][f"deepspeed-zero{stage}-clip"]
    norms: list = []
    weights, G, g_min, W = reference("sgd", 1, worker.CLIP, norms)
    assert min(norms) > worker.CLIP  # every step clips
    # a norm sums the squares of the gradient's 23 entries, each within 64 u G: within 23 * 64 u G of the truth
    assert max(abs(a - b) for a, b in zip(case["norms"], norms)) <= N_PARAMS * 64 * U * G
    assert max_difference(case["weights"], weights) <= bound("sgd", 1, G, g_min, W)


@pytest.mark.parametrize("stage", [s for s in worker.STAGES if s])
def test_offload_trains_like_one_process_and_saves_a_portable_file(launches, stage):
    """``ud.init(backend="deepspeed", zero_stage=S, offload_optimizer="cpu")`` (and ``offload_param="cpu"`` at
    ZeRO-3), AdamW with accumulation 2: the engine offloads what was asked, the user's torch AdamW steps the
    partitions in CPU memory, and 2 ranks x batch 4 give 1 process x batch 8 (float64) within :func:`bound`.
    ``ud.save`` of the offloaded model and optimizer writes the portable format: the final weights, and torch's
    AdamW state (a step count and two moments of each parameter's shape) for each of the model's parameters."""
    ranks = finished(launches, "physics")
    case = ranks[0][f"deepspeed-zero{stage}-offload"]
    assert (case["backend"], case["stage"]) == ("deepspeed", stage)
    assert case["offload"] == {"optimizer": "cpu", "param": "cpu" if stage == 3 else None}
    weights, G, g_min, W = reference("adamw", 2)
    assert max_difference(case["weights"], weights) <= bound("adamw", 2, G, g_min, W)
    assert ranks[1][f"deepspeed-zero{stage}-offload"]["weights"] == case["weights"]
    saved = torch.load(case["offloaded_file"], weights_only=True)
    assert max_difference(case["weights"], {n: t.double().flatten() for n, t in saved["model"].items()}) == 0
    state = saved["optimizer"]["state"]
    shapes = [tuple(p.shape) for p in worker.model().parameters()]
    assert sorted(state) == list(range(len(shapes)))
    assert [(tuple(state[i]["exp_avg"].shape), tuple(state[i]["exp_avg_sq"].shape)) for i in range(len(shapes))] == \
        [(shape, shape) for shape in shapes]
    assert {float(state[i]["step"]) for i in state} == {worker.ROWS // (2 * worker.BATCH * 2)}


@pytest.mark.parametrize("stage", worker.STAGES)
@pytest.mark.parametrize("opt_name", worker.OPTIMIZERS)
def test_each_stage_shards_what_it_says(launches, stage, opt_name):
    """Stage 0 keeps the whole optimizer state on every rank (SGD: one momentum per parameter, AdamW: two
    moments); ZeRO 1-3 hold each rank's partition only: less than the whole on each rank, all of it together."""
    ranks = finished(launches, "physics")
    per_param = 1 if opt_name == "sgd" else 2
    held = [ranks[r][worker.case_name("deepspeed", stage, opt_name, 1)]["held"] for r in (0, 1)]
    if stage == 0:
        assert held == [per_param * N_PARAMS] * 2
    else:
        assert all(h < per_param * N_PARAMS for h in held) and sum(held) >= per_param * N_PARAMS


@pytest.mark.parametrize("name", ["variable", "accelerate", "unified-dist"])
def test_each_selector_runs_the_engine_at_the_stage_it_says(launches, name):
    """UNIFIED_DIST_BACKEND=deepspeed under mpirun (stage from UNIFIED_DIST_ZERO_STAGE=1); accelerate launch
    --use_deepspeed --deepspeed_config_file (stage 3 from the file, which the settings table's launcher column
    reads: without it --use_deepspeed gives stage 2) with :data:`ACCELERATE_WORDS` (offload and clipping, which
    the engine takes too: its weights are 1 process's with torch's clip at every step); unified-dist
    launch --backend deepspeed --zero-stage 3, which runs DeepSpeed's own launcher (detected by its
    CROSS_RANK/CROSS_SIZE/LOCAL_SIZE): the backend and the stage each names, and the physics of the global batch."""
    ranks = finished(launches, name)
    words = name == "accelerate"  # ACCELERATE_WORDS: offload both, clip to worker.CLIP in the engine's step
    said = launches.get(name)[0].output.count("accelerate launch --zero3_init_flag true: a facade script builds")
    assert said == (2 if words else 0), launches.get(name)[0].output[-3000:]
    norms: list = []
    weights, G, g_min, W = reference("sgd", 1, worker.CLIP, norms) if words else reference("sgd", 1)
    assert not words or min(norms) > worker.CLIP  # the launcher's clip bites at every step
    for r in (0, 1):
        case = ranks[r]["detected-sgd-k1"]
        assert (case["backend"], case["launcher"], case["world_size"], case["stage"]) == (
            "deepspeed", LAUNCHER[name], 2, STAGE[name])
        assert case["offload"] == ({"optimizer": "cpu", "param": "cpu"} if words else
                                   {"optimizer": None, "param": None})
        assert case["clipping"] == (worker.CLIP if words else 0.0) and case["norms"] == []  # the loop never clips
        assert max_difference(case["weights"], weights) <= bound("sgd", 1, G, g_min, W)
    if name == "variable":  # one gloo group of mpirun's processes, each at the rank mpirun gave it
        assert [(ranks[r]["detected-sgd-k1"]["group"], ranks[r]["detected-sgd-k1"]["launcher_ranks"][
            "OMPI_COMM_WORLD_RANK"]) for r in (0, 1)] == [("gloo", "0"), ("gloo", "1")]


@pytest.mark.parametrize("name", list(CODE_STAGE))
def test_the_engine_joins_the_processes_another_stacks_launcher_started(launches, name, request):
    """ud.init(backend="deepspeed", zero_stage=S) in a script that horovodrun or srun started: DeepSpeed's engine at
    stage S over one torch.distributed group (gloo on this CPU) of the launcher's 2 processes, each keeping the rank
    its launcher gave it (HOROVOD_RANK, SLURM_PROCID); under horovodrun, Horovod's own library is not started (its
    launcher only starts the processes). 2 ranks x batch 4 give 1 process x batch 8 (plain torch, float64) within
    :func:`bound`."""
    if name == "horovodrun" and shutil.which("horovodrun", path=str(BIN)) is None:
        unavailable("no horovodrun here (make setup builds Horovod)")
    cluster = request.getfixturevalue("slurm_cluster") if name == "srun" else None
    ranks = finished(launches, name, cluster)
    weights, G, g_min, W = reference("sgd", 1)
    for r in (0, 1):
        case = ranks[r][f"code-zero{CODE_STAGE[name]}-sgd-k1"]
        assert (case["backend"], case["launcher"], case["world_size"], case["stage"], case["group"]) == (
            "deepspeed", name, 2, CODE_STAGE[name], "gloo")
        assert (case["rank"], case["launcher_ranks"][LAUNCHER_RANK[name]]) == (r, str(r))
        assert case["horovod_started"] is False
        assert case["steps"] == worker.ROWS // (2 * worker.BATCH)
        assert max_difference(case["weights"], weights) <= bound("sgd", 1, G, g_min, W)


def test_the_engine_leaves_no_shared_memory_behind(launches):
    """DeepSpeed's CPU all-reduce maps a 69 MB shared-memory buffer per rank under its own launcher (every rank on
    this host) and never unlinks it: before the engine unlinked each rank's name once all had mapped them, every
    such run left its buffers in /dev/shm, in memory, until the machine restarted (8.2 GB of them here)."""
    result, ranks = launches.get("unified-dist")
    result.check()
    assert sorted(ranks) == [0, 1]
    command = launches.commands["unified-dist"]
    port = command[command.index("--master-port") + 1]
    left = sorted(p.name for p in SHARED_MEMORY.glob(shared_buffer("*", port, "*")))
    assert left == [], left


def test_another_backend_under_use_deepspeed_is_refused_in_one_line(launches):
    """Under accelerate launch --use_deepspeed, ud.init(backend="accelerate") would train plain DDP: refused, on
    every rank, with one line."""
    ranks = finished(launches, "accelerate")
    for r in (0, 1):
        refused = ranks[r]["refused"]
        assert refused["type"] == "LaunchError" and "\n" not in refused["message"]
        assert "--use_deepspeed would train without DeepSpeed" in refused["message"]


@pytest.mark.parametrize("stage", worker.STAGES)
def test_checkpoints_are_portable_under_every_stage(launches, stage):
    """ud.save of the model writes the portable format under every stage (the float32 weights the run ended with,
    by parameter name), ud.save of the optimizer torch's state_dict layout (one entry per parameter, numbered in
    the groups' order, each moment shaped like its parameter; the group's hyperparameters), and ud.load into the
    prepared model is accepted: nothing is refused."""
    ranks = finished(launches, "physics")
    case = ranks[0][worker.case_name("deepspeed", stage, "sgd", 1)]
    outcome = case["checkpoint"]
    assert [outcome[name] for name in ("save_model", "save_optimizer", "load_model")] == [None] * 3, outcome
    saved = torch.load(outcome["file"], weights_only=True)["model"]
    assert {n: t.double().flatten().tolist() for n, t in saved.items()} == case["weights"]
    optimizer = torch.load(outcome["optimizer_file"], weights_only=True)["optimizer"]
    shapes = [tuple(p.shape) for p in worker.model().parameters()]
    assert [{k: v for k, v in g.items() if k in ("lr", "momentum", "params")} for g in optimizer["param_groups"]] == [
        {"lr": 0.1, "momentum": 0.9, "params": list(range(len(shapes)))}]
    assert {i: {k: tuple(v.shape) for k, v in entry.items()} for i, entry in optimizer["state"].items()} == {
        i: {"momentum_buffer": shape} for i, shape in enumerate(shapes)}


# The reshard chain: DDP -> ZeRO-1 -> ZeRO-2 -> ZeRO-3 -> FSDP2 in the "variable" launch (mpirun, after its
# selector case: one session each), then one process here; each leg resumes the previous leg's ud.save file (model,
# AdamW, step) and trains CHAIN_STEPS steps. (The physics launch, 21 engines, is near its timeout under load already.)
CHAIN = list(worker.CHAIN)


def chain_reference(steps: int) -> Tuple[Dict[int, Dict[str, torch.Tensor]], float, float, float]:
    """The uninterrupted run, 1 process in float64, plain torch (no unified_dist): the weights after every step
    (by parameter name, flattened) and, over the whole run, the largest gradient entry G, the smallest |gradient
    entry| g_min and the largest |weight| W (for :func:`bound`'s AdamW derivation)."""
    x, y = (t.double() for t in worker.data())
    net = worker.model().double()
    opt = worker.optimizer("adamw", net.parameters())
    after, big, small = {}, 0.0, math.inf
    for step in range(steps):
        rows = worker.chain_rows(step)
        torch.nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
        grads = torch.cat([p.grad.flatten() for p in net.parameters()]).abs()
        big, small = max(big, grads.max().item()), min(small, grads.min().item())
        opt.step()
        opt.zero_grad()
        after[step + 1] = {n: p.detach().flatten().clone() for n, p in net.named_parameters()}
    return after, big, small, max(p.abs().max().item() for p in net.parameters())


def chain_bound(steps: int, G: float, g_min: float, W: float) -> float:
    """:func:`bound`'s AdamW derivation over ``steps`` steps (float32 against float64; each checkpoint moves the
    float32 values unchanged, so the legs add no rounding of their own)."""
    return steps * (0.01 * 3.16 * 1.5 * 64 * U * G / g_min + 4 * U * W)


def last_leg(launches: Launches) -> dict:
    """The chain's last leg, one process in this test process: the FSDP2 leg's file loaded into a fresh model and
    AdamW on the torch backend, CHAIN_STEPS steps on the whole global batches. Once per module."""
    if "last-leg" not in launches._done:
        import unified_dist as ud

        ranks = finished(launches, "variable")
        previous = ranks[0][f"chain-{CHAIN[-1]}"]
        ud.init(backend="torch")
        try:
            net = worker.model()
            model, opt = ud.prepare(net, worker.optimizer("adamw", net.parameters()))
            extra = ud.load(previous["file"], {"model": model, "optimizer": opt})
            leg = {"extra": extra, "loaded": worker.witness(ud, model, opt), "steps_taken_loaded": opt.steps_taken}
            x, y = worker.data()
            for step in range(extra["step"], extra["step"] + worker.CHAIN_STEPS):
                rows = worker.chain_rows(step)
                ud.backward(torch.nn.functional.mse_loss(model(x[rows]), y[rows]))
                opt.step()
                opt.zero_grad()
            leg["saved"] = worker.witness(ud, model, opt)
        finally:
            ud.shutdown()
        launches._done["last-leg"] = leg
    return launches._done["last-leg"]


def chain_legs(launches: Launches) -> List[Tuple[str, dict]]:
    ranks = finished(launches, "variable")
    return [(name, ranks[0][f"chain-{name}"]) for name in CHAIN] + [("one-process", last_leg(launches))]


@pytest.mark.parametrize("index", range(1, len(CHAIN) + 1))
def test_reshard_chain_leg_resumes_the_previous_legs_checkpoint_exactly(launches, index):
    """Just after ud.load, the leg's weights (DeepSpeed's float32 master weights under ZeRO), both AdamW moments and
    its step count equal, bitwise, what the previous leg held when it saved (each read with its engine's own API,
    not the facade's): DDP -> ZeRO-1, ZeRO-1 -> ZeRO-2, ZeRO-2 -> ZeRO-3, ZeRO-3 -> FSDP2, FSDP2 -> one process."""
    legs = chain_legs(launches)
    (_, before), (name, leg) = legs[index - 1], legs[index]
    assert leg["loaded"] == before["saved"], name
    assert leg["steps_taken_loaded"] == index * worker.CHAIN_STEPS
    if name != "one-process":
        assert (leg["backend"], leg["stage"]) == ({"zero1": ("deepspeed", 1), "zero2": ("deepspeed", 2), "zero3": (
            "deepspeed", 3), "fsdp2": ("torch", None)}[name])


def test_reshard_chain_ends_on_the_uninterrupted_weights(launches):
    """Every leg's weights after its steps, the last one's (one process) included, are the uninterrupted run's
    (1 process in float64, plain torch) at that step count, within :func:`chain_bound`: AdamW's moments and step
    count went through every checkpoint (a leg that restarted them would take a step of size lr in every weight)."""
    legs = chain_legs(launches)
    steps = len(legs) * worker.CHAIN_STEPS
    after, G, g_min, W = chain_reference(steps)
    for index, (name, leg) in enumerate(legs):
        done = (index + 1) * worker.CHAIN_STEPS
        assert leg["saved"]["step"] == done, (name, leg["saved"]["step"])
        difference = max_difference(leg["saved"]["weights"], after[done])
        assert difference <= chain_bound(done, G, g_min, W), (name, difference, chain_bound(done, G, g_min, W))


def test_a_plain_deepspeed_checkpoint_directory_loads(launches):
    """A directory that a plain DeepSpeed script wrote (deepspeed.initialize under ZeRO-3, engine.save_checkpoint)
    loads with ud.load(dir, {"model": model}) into a model in one process: the float32 weights that script ended
    with (read there with DeepSpeed's safe_get_full_fp32_param), bitwise; ud.load(dir) returns them as
    {"model": weights}. Its optimizer's state is refused in one line (it stays in DeepSpeed's layout)."""
    import unified_dist as ud

    plain = finished(launches, "variable")[0]["plain-deepspeed"]
    ud.init(backend="torch")
    try:
        model = worker.model()
        assert ud.load(plain["directory"], {"model": model}) == {}
        weights = {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()}
        whole = ud.load(plain["directory"])
        with pytest.raises(ud.CheckpointError) as refused:
            ud.load(plain["directory"], {"model": model, "optimizer": torch.optim.AdamW(model.parameters())})
    finally:
        ud.shutdown()
    assert weights == plain["weights"]
    assert list(whole) == ["model"] and {n: t.double().flatten().tolist() for n, t in whole["model"].items()} == weights
    assert "\n" not in str(refused.value) and "gives one model's weights only" in str(refused.value)
