"""A user's DeepSpeed setups as Hugging Face documents them, in a script that never imports unified_dist
(tests/launchers/test_accelerate_deepspeed.py runs it through ``python -m unified_dist.accelerate``):

- ``plugin``: an Accelerate loop with ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2,
  gradient_clipping=CLIP))``, the model and optimizer of tests/launchers/workers/deepspeed_worker.py (SGD with
  momentum), batch ``BATCH`` per process, one epoch;
- ``launcher``: the same loop with a plain ``Accelerator()``, whose plugin Accelerate builds from ``accelerate launch
  --use_deepspeed --zero_stage 2 --gradient_clipping CLIP``'s variables;
- ``dummy``: a DeepSpeed config with ``optimizer`` and ``scheduler`` sections (``--optimizer-config``), the script's
  ``DummyOptim``/``DummyScheduler`` filling its ``"auto"``: DeepSpeed builds the optimizer and the schedule;
- ``trainer``: transformers' ``Trainer`` with ``TrainingArguments(deepspeed=<a ds_config.json>)`` whose batch sizes,
  accumulation and clipping say ``"auto"`` (transformers fills them from the arguments: batch ``BATCH``,
  ``max_grad_norm=CLIP``), the same model behind a ``forward(x, labels)`` that returns the loss, SGD with the
  same momentum through ``optim="sgd"``, a constant learning rate and the data in order;
- ``sft``: TRL's ``SFTTrainer`` with ``SFTConfig(deepspeed=<the same config>)`` on a tiny ``LlamaForCausalLM`` and
  ragged texts of tests/launchers/workers/trainer_family.py's word-level tokenizer, otherwise as ``trainer``;
- ``dpo``: TRL's ``DPOTrainer`` with ``DPOConfig(deepspeed=<the same config>)``, the same model as policy and a second
  one as its frozen reference (TRL puts that one in a DeepSpeed engine of its own), on ragged preference triples.

The main process appends one JSON line per part to ``--out``: the distributed type (for the Trainer also that of
the state its ``TrainingArguments`` built first), the number of processes, the ZeRO stage DeepSpeed's engine ran,
and the final full weights by parameter name (``dummy``: also the optimizer and schedule DeepSpeed built, and each
step's learning rate). ``--parts`` runs several in one process, each ``Accelerator`` the first of its state.
Every process also writes ``--out.exit-rank<R>.json`` as it exits: the process groups DeepSpeed still references
after unified_dist's exit handler ran (a group held there lives into the interpreter's finalization, where gloo's
threads can abort the process after its work: "terminate called without an active exception").
"""
import argparse
import atexit
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepspeed_worker as worker  # noqa: E402  (model, data, optimizer: the physics test rebuilds them)

DUMMY_LR, DUMMY_WEIGHT_DECAY, WARMUP = 0.01, 0.01, 4  # the dummy part's DummyOptim and DummyScheduler


class Regression(torch.nn.Module):
    """``worker.model()`` with the ``forward(**batch) -> {"loss": ...}`` a ``Trainer`` calls."""

    def __init__(self):
        super().__init__()
        self.net = worker.model()

    def forward(self, x, labels):
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def weights(module) -> dict:
    return {name: p.detach().double().flatten().tolist() for name, p in module.named_parameters()}


def train(accelerator, model, optimizer, loader, scheduler=None) -> tuple:
    """One epoch of the Accelerate loop as its examples write it; the prepared engine and each step's learning
    rate as DeepSpeed's engine applied it."""
    model, optimizer, loader, *scheduler = accelerator.prepare(model, optimizer, loader, *(
        [scheduler] if scheduler is not None else []))
    lrs = []
    for xb, yb in loader:
        lrs.append(model.get_lr()[0])
        accelerator.backward(torch.nn.functional.mse_loss(model(xb), yb))
        optimizer.step()
        for each in scheduler:
            each.step()
        optimizer.zero_grad()
    return model, lrs


def row(part, accelerator, engine, **more) -> dict:
    return {"part": part, "distributed_type": str(accelerator.distributed_type),
            "num_processes": accelerator.num_processes, "engine": type(engine).__name__,
            "zero_stage": engine.zero_optimization_stage(), "weights": weights(accelerator.unwrap_model(engine)),
            **more}


def run_plugin(options, write):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_clipping=worker.CLIP))
    x, y = worker.data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=worker.BATCH)
    model = worker.model()
    engine, _ = train(accelerator, model, worker.optimizer("sgd", model.parameters()), loader)
    write(row("plugin", accelerator, engine))


def run_launcher(options, write):
    """A plain ``Accelerator()``: under ``accelerate launch --use_deepspeed --zero_stage 2 --gradient_clipping
    CLIP`` Accelerate builds the plugin from the launcher's variables (Accelerate's own
    ``examples/by_feature/deepspeed_with_config_support.py`` has no plugin in its code either)."""
    from accelerate import Accelerator

    accelerator = Accelerator()
    x, y = worker.data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=worker.BATCH)
    model = worker.model()
    engine, _ = train(accelerator, model, worker.optimizer("sgd", model.parameters()), loader)
    write(row("launcher", accelerator, engine,
              gradient_clipping=accelerator.state.deepspeed_plugin.deepspeed_config.get("gradient_clipping")))


def run_dummy(options, write):
    """A DeepSpeed config with ``optimizer`` and ``scheduler`` sections (``--optimizer-config``): the script hands
    Accelerate ``DummyOptim``/``DummyScheduler`` (their ``lr``, ``weight_decay`` and ``warmup_num_steps`` fill the
    config's ``"auto"``), and DeepSpeed builds the optimizer and the schedule itself."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=options.optimizer_config))
    x, y = worker.data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=worker.BATCH)
    model = worker.model()
    optimizer = DummyOptim(model.parameters(), lr=DUMMY_LR, weight_decay=DUMMY_WEIGHT_DECAY)
    engine, lrs = train(accelerator, model, optimizer, loader, DummyScheduler(optimizer, warmup_num_steps=WARMUP))
    built = type(engine.basic_optimizer)
    write(row("dummy", accelerator, engine, optimizer=f"{built.__module__}.{built.__qualname__}",
              scheduler=type(engine.lr_scheduler).__name__, lrs=lrs))


def run_trainer(options, write):
    from transformers import Trainer, TrainingArguments

    x, y = worker.data()
    rows = [{"x": x[i], "labels": y[i]} for i in range(worker.ROWS)]
    args = TrainingArguments(
        output_dir=options.output_dir, deepspeed=options.deepspeed, per_device_train_batch_size=worker.BATCH,
        num_train_epochs=1, optim="sgd", optim_args="momentum=0.9", learning_rate=0.1, weight_decay=0.0,
        lr_scheduler_type="constant", max_grad_norm=worker.CLIP, train_sampling_strategy="sequential",
        average_tokens_across_devices=False, save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    model = Regression()
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    result = trainer.train()
    engine = trainer.model_wrapped
    write({"part": "trainer", "distributed_type": str(trainer.accelerator.distributed_type),
           "arguments_state": str(args.distributed_state.distributed_type),
           "num_processes": trainer.accelerator.num_processes, "engine": type(engine).__name__,
           "zero_stage": engine.zero_optimization_stage(), "global_step": result.global_step,
           "weights": {name.removeprefix("net."): value for name, value in weights(model).items()}})


SFT_LR, SFT_MAX_LENGTH = 0.1, 32  # the sft part's learning rate (SGD, momentum 0.9) and SFTConfig.max_length


def sft_texts() -> list:
    """``worker.ROWS`` texts of ragged lengths (4 to 12 words of trainer_family's tokenizer), so SFT's loss, a mean
    over the tokens of the global batch, weighs the examples of a step unequally."""
    generator = torch.Generator().manual_seed(5)
    texts = []
    for _ in range(worker.ROWS):
        start, length = torch.randint(0, 60, (2,), generator=generator).tolist()
        texts.append(" ".join(f"w{(start + 7 * k) % 60}" for k in range(4 + length % 9)))
    return texts


def run_sft(options, write):
    """TRL's ``SFTTrainer`` with ``SFTConfig(deepspeed=<the auto config>)``: the model, texts and tokenizer above,
    SGD with momentum through ``optim="sgd"``, a constant learning rate, the data in order, the "auto" clipping
    transformers' ``max_grad_norm`` (``worker.CLIP``) and TRL's default loss (the mean over the global batch's
    tokens: ``average_tokens_across_devices``); ``bf16`` and gradient checkpointing off (TRL's defaults are on).
    Its row also holds the token ids TRL trained on and the part's seconds (TRL's import included); a model that
    DeepSpeed left out (a silent DDP: the Trainer trains it to the end) is written too, its stage ``None``."""
    started = time.perf_counter()
    from datasets import Dataset
    from trainer_family import causal_lm, word_tokenizer
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(
        output_dir=options.output_dir + "-sft", deepspeed=options.deepspeed, per_device_train_batch_size=worker.BATCH,
        num_train_epochs=1, optim="sgd", optim_args="momentum=0.9", learning_rate=SFT_LR, weight_decay=0.0,
        lr_scheduler_type="constant", max_grad_norm=worker.CLIP, train_sampling_strategy="sequential",
        bf16=False, gradient_checkpointing=False, max_length=SFT_MAX_LENGTH, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0)
    model = causal_lm()
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": sft_texts()}),
                         processing_class=word_tokenizer())
    result = trainer.train()
    engine = trainer.model_wrapped
    write({"part": "sft", "distributed_type": str(trainer.accelerator.distributed_type),
           "arguments_state": str(config.distributed_state.distributed_type),
           "num_processes": trainer.accelerator.num_processes, "engine": type(engine).__name__,
           "zero_stage": getattr(engine, "zero_optimization_stage", lambda: None)(), "global_step": result.global_step,
           "input_ids": list(trainer.train_dataset["input_ids"]), "weights": weights(model),
           "seconds": time.perf_counter() - started})


DPO_ROWS, DPO_LR, DPO_BETA = 16, 0.1, 0.1  # the dpo part: preference triples, SGD's learning rate, DPO's beta


def dpo_rows() -> dict:
    """``DPO_ROWS`` triples of trainer_family's words: a prompt of 3-6 words, a chosen and a rejected completion of
    2-4 (each starting with a space, so the tokenizer splits it from the prompt's last word)."""
    generator = torch.Generator().manual_seed(7)

    def words(n: int) -> str:
        return " ".join(f"w{i}" for i in torch.randint(0, 60, (n,), generator=generator).tolist())
    return {"prompt": [words(3 + i % 4) for i in range(DPO_ROWS)],
            "chosen": [" " + words(2 + i % 3) for i in range(DPO_ROWS)],
            "rejected": [" " + words(2 + (i + 1) % 3) for i in range(DPO_ROWS)]}


def run_dpo(options, write):
    """TRL's ``DPOTrainer`` with ``DPOConfig(deepspeed=<the auto config>)``: trainer_family's causal LM as the policy
    and a second one (the same weights) as the frozen reference, the default sigmoid loss at ``DPO_BETA``, SGD with
    momentum, a constant learning rate, the data in order, the "auto" clipping transformers' ``max_grad_norm``
    (``worker.CLIP``). Its row holds both models' engines and stages, the token ids TRL trained on and the policy's
    final weights."""
    from datasets import Dataset
    from trainer_family import causal_lm, word_tokenizer
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(
        output_dir=options.output_dir + "-dpo", deepspeed=options.deepspeed, per_device_train_batch_size=worker.BATCH,
        num_train_epochs=1, optim="sgd", optim_args="momentum=0.9", learning_rate=DPO_LR, weight_decay=0.0,
        lr_scheduler_type="constant", max_grad_norm=worker.CLIP, train_sampling_strategy="sequential", beta=DPO_BETA,
        bf16=False, gradient_checkpointing=False, max_length=32, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0)
    model = causal_lm()
    trainer = DPOTrainer(model=model, ref_model=causal_lm(), args=config, train_dataset=Dataset.from_dict(dpo_rows()),
                         processing_class=word_tokenizer())
    result = trainer.train()
    engine, data = trainer.model_wrapped, trainer.train_dataset
    write({"part": "dpo", "distributed_type": str(trainer.accelerator.distributed_type),
           "arguments_state": str(config.distributed_state.distributed_type),
           "num_processes": trainer.accelerator.num_processes, "engine": type(engine).__name__,
           "zero_stage": getattr(engine, "zero_optimization_stage", lambda: None)(),
           "reference_engine": type(trainer.ref_model).__name__, "global_step": result.global_step,
           "ids": {key: [list(ids) for ids in data[key]] for key in ("prompt_ids", "chosen_ids", "rejected_ids")},
           "weights": weights(model)})


PARTS = {"plugin": run_plugin, "launcher": run_launcher, "dummy": run_dummy, "trainer": run_trainer, "sft": run_sft,
         "dpo": run_dpo}


def record_exit(out: str) -> None:
    """Registered before any Accelerator, so it runs after unified_dist's exit handler (atexit runs the last
    registered first): which of DeepSpeed's module-level group references still hold a group."""
    groups = sys.modules.get("deepspeed.utils.groups")
    held = sorted(name for name, value in vars(groups).items()
                  if "GROUP" in name and value not in (None, {}, [])) if groups is not None else None
    with open(f"{out}.exit-rank{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump({"deepspeed_groups_held": held}, f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--output-dir", required=True, help="the Trainer's output_dir")
    parser.add_argument("--deepspeed", required=True, help="the Trainer's DeepSpeed config file")
    parser.add_argument("--optimizer-config", help="the dummy part's DeepSpeed config file")
    parser.add_argument("--parts", default="plugin,trainer")
    options = parser.parse_args()
    atexit.register(record_exit, options.out)

    def write(row):
        if int(os.environ.get("RANK", "0")) == 0:
            with open(options.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    for i, part in enumerate(options.parts.split(",")):
        if i:  # each part's Accelerator is the first of its state, as in a script of its own (the group is kept)
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state()
        PARTS[part](options, write)


if __name__ == "__main__":
    main()
