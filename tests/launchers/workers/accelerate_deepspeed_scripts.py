"""A user's DeepSpeed setups as Hugging Face documents them, in a script that never imports unified_dist
(tests/launchers/test_accelerate_deepspeed.py runs it through ``python -m unified_dist.accelerate``):

- ``plugin``: an Accelerate loop with ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2,
  gradient_clipping=CLIP))``, the model and optimizer of tests/launchers/workers/deepspeed_worker.py (SGD with
  momentum), batch ``BATCH`` per process, one epoch;
- ``trainer``: transformers' ``Trainer`` with ``TrainingArguments(deepspeed=<a ds_config.json>)`` whose batch sizes,
  accumulation and clipping say ``"auto"`` (transformers fills them from the arguments: batch ``BATCH``,
  ``max_grad_norm=CLIP``), the same model behind a ``forward(x, labels)`` that returns the loss, SGD with the
  same momentum through ``optim="sgd"``, a constant learning rate and the data in order.

The main process appends one JSON line per part to ``--out``: the distributed type (for the Trainer also that of
the state its ``TrainingArguments`` built first), the number of processes, the ZeRO stage DeepSpeed's engine ran,
and the final full weights by parameter name.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepspeed_worker as worker  # noqa: E402  (model, data, optimizer: the physics test rebuilds them)


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


def run_plugin(options, write):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_clipping=worker.CLIP))
    x, y = worker.data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=worker.BATCH)
    model = worker.model()
    model, optimizer, loader = accelerator.prepare(model, worker.optimizer("sgd", model.parameters()), loader)
    for xb, yb in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()
    write({"part": "plugin", "distributed_type": str(accelerator.distributed_type),
           "num_processes": accelerator.num_processes, "engine": type(model).__name__,
           "zero_stage": model.zero_optimization_stage(), "weights": weights(accelerator.unwrap_model(model))})


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--output-dir", required=True, help="the Trainer's output_dir")
    parser.add_argument("--deepspeed", required=True, help="the Trainer's DeepSpeed config file")
    parser.add_argument("--parts", default="plugin,trainer")
    options = parser.parse_args()

    def write(row):
        if int(os.environ.get("RANK", "0")) == 0:
            with open(options.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    for part in options.parts.split(","):
        {"plugin": run_plugin, "trainer": run_trainer}[part](options, write)


if __name__ == "__main__":
    main()
