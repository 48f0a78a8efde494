"""Issue 59 item 4: the DeepSpeed setups Accelerate and transformers users already have run unchanged through
``python -m unified_dist.accelerate`` on a machine without a GPU, with the numbers of one process on the global batch.

The script is tests/launchers/workers/accelerate_deepspeed_scripts.py (it never imports unified_dist), in parts:

- ``plugin``: an Accelerate loop with ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2,
  gradient_clipping=0.2))``;
- ``launcher``: the same loop with a plain ``Accelerator()``, whose plugin Accelerate builds from ``accelerate launch
  --use_deepspeed --zero_stage 2 --gradient_clipping 0.2``'s variables;
- ``dummy``: a DeepSpeed config with ``optimizer`` (AdamW, ``"torch_adam": true``) and ``scheduler`` (WarmupLR)
  sections, their ``"auto"`` values filled from the script's ``DummyOptim``/``DummyScheduler``: DeepSpeed builds both;
- ``trainer``: transformers' ``Trainer`` with ``TrainingArguments(deepspeed="deepspeed_auto.json")``, a config whose
  batch sizes, accumulation and clipping say ``"auto"``;
- ``sft``: TRL's ``SFTTrainer`` with ``SFTConfig(deepspeed="deepspeed_auto.json")`` on a tiny ``LlamaForCausalLM``
  (run in torchrun's launch only: its path is the Trainer's, which every other launcher but srun runs);
- ``dpo``: TRL's ``DPOTrainer`` with ``DPOConfig(deepspeed="deepspeed_auto.json")``, the same tiny causal LM as the
  policy and its frozen reference, which TRL puts in a second DeepSpeed engine (run in horovodrun's launch).

Five launches, 2 processes each, one per launcher, each running the parts it needs (LAUNCHES), shared by every
assertion: ``torchrun -m unified_dist.accelerate``, ``horovodrun ... python -m unified_dist.accelerate``, ``accelerate
launch --use_deepspeed ... -m unified_dist.accelerate``, ``srun``/``mpirun ... python -m unified_dist.accelerate``
(horovodrun's, srun's and mpirun's variables Accelerate and DeepSpeed do not read: the runner exports the world).

Accelerate alone cannot do this here: without ``cpu=True`` its DeepSpeed path starts DeepSpeed's communication with
no backend and counts a world of one (DeepSpeed then stops: ``train_batch_size ... 4 != 4 * 1 * 2``); with
``cpu=True`` it leaves DeepSpeed out. The runner gives that path the backend gloo (DeepSpeed's CPU accelerator uses
it without oneCCL), and refuses in one line a plugin Accelerate would leave out, or a ``DummyOptim`` without
DeepSpeed (tests/unit/backends/test_deepspeed_backend.py).

Physics: 2 ranks x batch 4 must give the weights of 1 process x batch 8, computed in float64 with plain torch in this
process; DeepSpeed runs float32, so the bounds are :func:`test_deepspeed_engine.bound`'s derivation:

- ``plugin``, ``launcher``, ``trainer``: SGD with momentum, each step's gradient clipped to norm 0.2 (below every
  step's norm of this run, so the clip is active and the "auto" clipping must have become the Trainer's
  ``max_grad_norm``); clipping scales each gradient by 0.2 / norm, which leaves that SGD bound as it is;
- ``dummy``: torch's AdamW with the config's hyper-parameters and WarmupLR's learning rates, at most 0.01 (the AdamW
  bound's learning rate, so that bound holds);
- ``sft``: SGD with momentum on the causal LM's loss, the mean over the global batch's target tokens, clipped as
  ``trainer``; the same derivation with the longer chain of that model (:data:`SFT_ROUNDINGS`, :func:`sft_bound`);
- ``dpo``: DPO's sigmoid loss over the global batch's 8 triples, from the policy's and the reference's summed
  log-probabilities of each completion, clipped as ``trainer``; the bound of ``sft`` (:func:`dpo_bound`).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from unified_dist.testing.launchers import ROOT, child_env, command, free_port, run

sys.path.insert(0, str(ROOT / "tests" / "launchers"))
sys.path.insert(0, str(ROOT / "tests" / "launchers" / "workers"))
import accelerate_deepspeed_scripts as scripts  # noqa: E402
import deepspeed_worker as worker  # noqa: E402
from test_deepspeed_engine import U, bound, max_difference, reference  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TIMEOUT = 420  # a launch took 58-75 s on 2 shared cores at load 2-7, 136-232 s at load 12-27 (mpirun the slowest)
SCRIPT = ROOT / "tests" / "launchers" / "workers" / "accelerate_deepspeed_scripts.py"
CONFIG = ROOT / "tests" / "launchers" / "workers" / "deepspeed_auto.json"
OPTIMIZER_CONFIG = ROOT / "tests" / "launchers" / "workers" / "deepspeed_optimizer.json"
LAUNCHES = {"torchrun": ("plugin", "trainer", "dummy", "sft"), "horovodrun": ("plugin", "trainer", "dpo"),
            "accelerate": ("launcher",), "srun": ("plugin",), "mpirun": ("trainer",)}
"""The parts each launch runs: every part once, each launcher both an ``Accelerator`` built first (``plugin`` or
``launcher``) and, but for ``accelerate launch`` and srun, the ``TrainingArguments`` state built first (``trainer``);
a launch costs more than a part (its processes import torch, Accelerate and DeepSpeed: about 30 s of the
75 s torchrun launch at load 2 went before the first engine), so each new launcher runs one part."""
FIXTURE = {"srun": "slurm_cluster", "mpirun": "mpirun_available"}
CASES = [pytest.param(launcher, part, marks=[pytest.mark.horovod] if launcher == "horovodrun" else [],
                      id=f"{part}-{launcher}")
         for launcher, parts in LAUNCHES.items() for part in parts]


def launcher_command(launcher: str, args: list) -> list:
    """``python -m unified_dist.accelerate SCRIPT args`` under ``launcher``, 2 processes."""
    runner = ["unified_dist.accelerate", str(SCRIPT), *args]
    if launcher == "accelerate":  # what the user types: Accelerate's DeepSpeed flags (on a CPU, without --cpu)
        return command("accelerate-deepspeed", "-m", runner,
                       launcher_flags=["--zero_stage", "2", "--gradient_clipping", str(worker.CLIP)])
    return command(launcher, "-m", runner)


def launch(launcher: str, folder: Path, env: dict) -> dict:
    """The main process's rows by part; a part written twice (two processes that each believed they were the
    main one) fails here."""
    out = folder / f"{launcher}.jsonl"
    args = ["--out", str(out), "--output-dir", str(folder / launcher), "--deepspeed", str(CONFIG),
            "--optimizer-config", str(OPTIMIZER_CONFIG), "--parts", ",".join(LAUNCHES[launcher])]
    run(launcher_command(launcher, args), TIMEOUT, child_env(env)).check()
    found = {}
    for row in map(json.loads, out.read_text().splitlines()):
        assert row["part"] not in found, f"{row['part']} written twice: a process trained alone"
        found[row["part"]] = row
    assert sorted(found) == sorted(LAUNCHES[launcher])
    return found


@pytest.fixture(scope="module")
def runs(module_dirs, request):
    """Each launch once per module, by the first test that needs it."""
    folder = module_dirs.mktemp("accelerate_deepspeed")
    done: dict = {}

    def get(launcher: str) -> dict:
        if launcher not in done:
            env = request.getfixturevalue(FIXTURE[launcher]) if launcher in FIXTURE else None
            env = dict(env) if isinstance(env, dict) else {}
            if launcher == "mpirun":  # mpirun says no port: the runner's rendezvous takes MASTER_PORT's
                env["MASTER_PORT"] = str(free_port())
            try:
                done[launcher] = launch(launcher, folder, env)
            except Exception as exc:  # noqa: BLE001 - kept: a second launch would append to the first one's rows
                done[launcher] = exc
        if isinstance(done[launcher], Exception):
            raise done[launcher]
        return done[launcher]
    get.folder = folder  # where each launch writes (its rows, its processes' exit records)
    return get


@pytest.fixture(scope="module")
def physics():
    """1 process x batch 8 in float64 (plain torch), clipped to worker.CLIP: the weights and the bound."""
    norms: list = []
    weights, G, g_min, W = reference("sgd", 1, clip=worker.CLIP, norms=norms)
    assert min(norms) > worker.CLIP  # the clip acts on every step
    return weights, bound("sgd", 1, G, g_min, W)


def warmup_lrs(steps: int) -> list:
    """The learning rate of each optimizer step under DeepSpeed's WarmupLR as its docstring and code define it
    (deepspeed/runtime/lr_schedules.py): ``min_lr`` until the schedule's first ``step()``, which the engine takes
    after each optimizer step; after ``i + 1`` of them ``min_lr + (max_lr - min_lr) * gamma`` with linear ``gamma =
    i / warmup_num_steps`` below ``warmup_num_steps``, else 1. The config's ``"auto"`` are Accelerate's fill-ins:
    ``min_lr`` 0, ``max_lr`` the ``DummyOptim``'s lr, ``warmup_num_steps`` the ``DummyScheduler``'s."""
    lrs, lr_max, n = [0.0], scripts.DUMMY_LR, scripts.WARMUP
    for i in range(steps - 1):
        lrs.append(lr_max * (i / n if i < n else 1.0))
    return lrs


@pytest.fixture(scope="module")
def adamw_physics():
    """The dummy part's run, 1 process x batch 8 in float64: torch's AdamW with the config's betas and eps and the
    DummyOptim's lr and weight decay, each step's lr WarmupLR's; the weights, the lrs and the AdamW bound (whose
    lr, 0.01, is the schedule's largest)."""
    steps = worker.ROWS // (2 * worker.BATCH)
    lrs = warmup_lrs(steps)
    assert max(lrs) == scripts.DUMMY_LR == 0.01 and len(set(lrs)) > 2  # the bound's lr; the schedule moves
    x, y = (t.double() for t in worker.data())
    net = worker.model().double()
    opt = torch.optim.AdamW(net.parameters(), lr=scripts.DUMMY_LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=scripts.DUMMY_WEIGHT_DECAY)
    big, small, batch = 0.0, math.inf, 2 * worker.BATCH
    for step, start in enumerate(range(0, worker.ROWS, batch)):
        torch.nn.functional.mse_loss(net(x[start:start + batch]), y[start:start + batch]).backward()
        grads = torch.cat([p.grad.flatten() for p in net.parameters()]).abs()
        big, small = max(big, grads.max().item()), min(small, grads.min().item())
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        opt.step()
        opt.zero_grad()
    weights = {n: p.detach().flatten() for n, p in net.named_parameters()}
    W = max(p.abs().max().item() for p in net.parameters())
    return weights, lrs, bound("adamw", 1, big, small, W)


SFT_ROUNDINGS = 4 * (2 * (2 * 300 + 32 + 64) + 8 * 13)
"""The float32 roundings a gradient entry of the sft part's model can collect, counted as the SGD bound above counts
them (each operation of a chain u, dot products and sums of n terms n u, a factor 4 to spare): a forward through 2
decoder layers of about 300 each (RMSNorm over 32, q/k/v and o over 32, scores over head dim 16, softmax and values
over <= 13 positions, gate and up over 32, down over 64), the head over 32 and the log-softmax over 64, the backward
through the same chain, and the sum over the <= 8 x 13 target tokens of a global batch: 6,000 u G."""


def sft_bound(G: float, W: float, steps: int) -> float:
    """:func:`bound`'s SGD derivation (lr, momentum 0.9's geometric sum 10, the weights' own 4 u W per step) with the
    sft part's learning rate and chain: ``steps (lr 10 SFT_ROUNDINGS u G + 4 u W)``. Clipping scales a step's gradient
    by CLIP / norm (< 1 here, with the norm's own relative error of a few u), so G, the largest entry before the
    clip, only overstates it."""
    return steps * (scripts.SFT_LR * 10 * SFT_ROUNDINGS * U * G + 4 * U * W)


def sft_tokens() -> list:
    """Each text's token ids as SFT trains on them, without TRL: trainer_family's tokenizer on the text and its EOS
    (TRL appends the EOS a text lacks)."""
    from trainer_family import word_tokenizer

    tokenizer = word_tokenizer()
    return [tokenizer(text + tokenizer.eos_token)["input_ids"] for text in scripts.sft_texts()]


def sft_reference(average_per_process: bool = False) -> tuple:
    """The sft part on 1 process x batch 8 in float64, plain torch: each step's loss the mean cross-entropy over the
    global batch's target tokens (each text's tokens after its first, no padding: right padding does not reach a
    causal model's real tokens), clipped to ``worker.CLIP``, SGD with momentum 0.9 at ``SFT_LR``; the weights, the
    clip's norms, the largest gradient entry G and the largest |weight| W. ``average_per_process``: the wrong physics
    of each half's own token mean, averaged (what 2 processes without ``average_tokens_across_devices`` train)."""
    from trainer_family import causal_lm

    tokens, batch = sft_tokens(), 2 * worker.BATCH
    net = causal_lm().double()
    opt = torch.optim.SGD(net.parameters(), lr=scripts.SFT_LR, momentum=0.9)
    norms, big = [], 0.0
    for start in range(0, len(tokens), batch):
        halves = [tokens[start:start + batch]] if not average_per_process else [
            tokens[start:start + worker.BATCH], tokens[start + worker.BATCH:start + batch]]
        for half in halves:
            count = sum(len(ids) - 1 for ids in half)
            for ids in half:
                ids = torch.tensor([ids])
                logits = net(input_ids=ids).logits[0, :-1]
                loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
                (loss / count / len(halves)).backward()
        big = max(big, max(p.grad.abs().max().item() for p in net.parameters()))
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), worker.CLIP).item())
        opt.step()
        opt.zero_grad()
    weights = {n: p.detach().flatten() for n, p in net.named_parameters()}
    return weights, norms, big, max(p.abs().max().item() for p in net.parameters())


@pytest.fixture(scope="module")
def sft_physics():
    """The sft part's float64 reference (1 process x batch 8), its token ids and its bound."""
    weights, norms, G, W = sft_reference()
    assert min(norms) > worker.CLIP  # the "auto" clipping acts on every step: it must have become max_grad_norm
    return weights, sft_tokens(), sft_bound(G, W, len(norms))


def dpo_tokens() -> dict:
    """Each triple's token ids as DPO trains on them, without TRL: trainer_family's tokenizer on the prompt, and on
    each completion with its EOS appended."""
    from trainer_family import word_tokenizer

    tokenizer, rows = word_tokenizer(), scripts.dpo_rows()
    eos = [tokenizer.eos_token_id]
    return {"prompt_ids": [tokenizer(text)["input_ids"] for text in rows["prompt"]],
            "chosen_ids": [tokenizer(text)["input_ids"] + eos for text in rows["chosen"]],
            "rejected_ids": [tokenizer(text)["input_ids"] + eos for text in rows["rejected"]]}


def dpo_reference(ids: dict) -> tuple:
    """The dpo part on 1 process x batch 8 in float64, plain torch: each step's loss the mean over the global batch's
    triples of ``-logsigmoid(beta ((pc - rc) - (pr - rr)))``, with ``pc``/``pr`` the policy's and ``rc``/``rr`` the
    frozen reference's summed log-probabilities of the chosen and rejected completion's tokens after the prompt
    (each sequence alone, unpadded), clipped to ``worker.CLIP``, SGD with momentum 0.9 at ``DPO_LR``; the weights,
    the clip's norms, the largest gradient entry G and the largest |weight| W."""
    from trainer_family import causal_lm

    policy, frozen = causal_lm().double(), causal_lm().double()
    opt = torch.optim.SGD(policy.parameters(), lr=scripts.DPO_LR, momentum=0.9)

    def logp(model, prompt: list, completion: list) -> torch.Tensor:
        sequence = torch.tensor([prompt + completion])
        logits = torch.log_softmax(model(input_ids=sequence).logits[0], dim=-1)
        return sum(logits[j - 1, sequence[0, j]] for j in range(len(prompt), sequence.shape[1]))

    batch, norms, big = 2 * worker.BATCH, [], 0.0
    for start in range(0, scripts.DPO_ROWS, batch):
        losses = []
        for i in range(start, start + batch):
            prompt, chosen, rejected = (ids[key][i] for key in ("prompt_ids", "chosen_ids", "rejected_ids"))
            with torch.no_grad():
                margin = logp(frozen, prompt, chosen) - logp(frozen, prompt, rejected)
            losses.append(-torch.nn.functional.logsigmoid(
                scripts.DPO_BETA * (logp(policy, prompt, chosen) - logp(policy, prompt, rejected) - margin)))
        torch.stack(losses).mean().backward()
        big = max(big, max(p.grad.abs().max().item() for p in policy.parameters()))
        norms.append(torch.nn.utils.clip_grad_norm_(policy.parameters(), worker.CLIP).item())
        opt.step()
        opt.zero_grad()
    weights = {n: p.detach().flatten() for n, p in policy.named_parameters()}
    return weights, norms, big, max(p.abs().max().item() for p in policy.parameters())


def dpo_bound(G: float, W: float, steps: int) -> float:
    """:func:`sft_bound`'s derivation at ``DPO_LR``: a gradient entry's chain is the same model's forward and backward
    (2 decoder layers, the head, the log-softmax over 64 words), summed over fewer terms (8 triples x 2 completions x
    at most 5 tokens, against sft's 104 target tokens), plus the log-sigmoid and beta's scaling (a few u): within
    :data:`SFT_ROUNDINGS` u G. The reference's own log-probabilities enter only through the sigmoid's argument, where
    their float32 error (the forward half of that chain) scales the gradient by less than it."""
    return steps * (scripts.DPO_LR * 10 * SFT_ROUNDINGS * U * G + 4 * U * W)


@pytest.fixture(scope="module")
def dpo_physics():
    """The dpo part's float64 reference (1 process x batch 8), the token ids it takes, and its bound."""
    ids = dpo_tokens()
    weights, norms, G, W = dpo_reference(ids)
    assert min(norms) > worker.CLIP  # the "auto" clipping acts on every step: it must have become max_grad_norm
    return weights, ids, dpo_bound(G, W, len(norms))


@pytest.mark.parametrize("launcher, part", CASES)
def test_deepspeed_runs_through_accelerates_own_path_on_two_cpu_processes(runs, launcher, part):
    row = runs(launcher)[part]
    assert (row["distributed_type"], row["num_processes"]) == ("DistributedType.DEEPSPEED", 2)
    assert (row["engine"], row["zero_stage"]) == ("DeepSpeedEngine", 2)
    if part in ("trainer", "sft", "dpo"):  # TrainingArguments' (SFTConfig's, DPOConfig's) state is DeepSpeed's too
        assert row["arguments_state"] == "DistributedType.DEEPSPEED"
        rows = scripts.DPO_ROWS if part == "dpo" else worker.ROWS
        assert row["global_step"] == rows // (2 * worker.BATCH)
    if part == "dpo":  # DPO's frozen reference model runs in a DeepSpeed engine of its own
        assert row["reference_engine"] == "DeepSpeedEngine"
    if part == "launcher":  # the plugin Accelerate built from accelerate launch's flags
        assert row["gradient_clipping"] == worker.CLIP
    if part == "dummy":  # DeepSpeed built the config's optimizer and schedule, not the script
        assert (row["optimizer"], row["scheduler"]) == ("torch.optim.adamw.AdamW", "WarmupLR")


@pytest.mark.parametrize("launcher", [pytest.param(name, marks=[pytest.mark.horovod] if name == "horovodrun" else [])
                                      for name in LAUNCHES])
def test_every_process_leaves_no_process_group_to_the_interpreters_finalization(runs, launcher):
    """After unified_dist's exit handler, DeepSpeed references no process group (tests/launchers/workers/
    accelerate_deepspeed_scripts.py records it from a handler that runs after ours). A fresh run of c124a51 saw
    rank 1 of the horovodrun launch abort after its work ("terminate called without an active exception"): the
    facade destroyed the groups, but DeepSpeed's module globals kept them alive into finalization, where gloo's
    threads race the dying interpreter; deepspeed.comm.destroy_process_group() drops them. Deterministic, where
    the crash came once in about ten full runs."""
    runs(launcher)
    for rank in (0, 1):
        path = runs.folder / f"{launcher}.jsonl.exit-rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no exit record"
        assert json.loads(path.read_text()) == {"deepspeed_groups_held": []}, (rank, path.read_text())


@pytest.mark.parametrize("launcher, part", CASES)
def test_two_ranks_give_one_process_on_the_global_batch(runs, physics, adamw_physics, request, launcher, part):
    row = runs(launcher)[part]
    if part == "sft":
        weights, tokens, limit = request.getfixturevalue("sft_physics")
        assert row["input_ids"] == tokens  # TRL trained on the tokens the reference takes
    elif part == "dpo":
        weights, tokens, limit = request.getfixturevalue("dpo_physics")
        assert row["ids"] == tokens  # TRL trained on the tokens the reference takes
    elif part == "dummy":
        weights, lrs, limit = adamw_physics
        assert row["lrs"] == pytest.approx(lrs, rel=1e-12, abs=0)  # each step's lr, as the engine applied it
    else:
        weights, limit = physics
    assert max_difference(row["weights"], weights) <= limit
