"""A Hugging Face fine-tuning script in the tutorials' shape: transformers' ``Trainer``, TRL's ``SFTTrainer``
and a PEFT LoRA adapter under ``Trainer``. It never imports unified_dist (tests/launchers/test_trainer_family.py
checks): run unchanged under torchrun (transformers' own path, the reference) and through ``python -m
unified_dist.accelerate`` under every other launcher.

Models are built from configs and data made here (no hub). Dropout is off, so the numbers depend on the
data order and the arithmetic only. The main process appends one JSON line per part to ``--out``:

- ``trainer``: a ``BertForSequenceClassification`` trained 2 epochs (64 examples, ``--batch`` per device),
  ``save_strategy="steps"`` every 6 steps into ``--output-dir``; then ``evaluate`` on 24 held-out examples
  (beside the mean loss over them computed here in plain torch), and ``predict`` on 21 (not a multiple of
  any world here);
- ``resume`` (with ``--resume FOLDER``): a fresh model and ``Trainer`` resumed from ``FOLDER`` (a
  ``checkpoint-N`` another launch wrote), trained to the end;
- ``mean``: ``trainer``'s training with ``average_tokens_across_devices=False`` (each process's loss its
  batch's mean), then ``evaluate`` on 24 examples (a multiple of 2 processes x 4) and on the 21;
- ``sft``: TRL's ``SFTTrainer`` on a tiny ``LlamaForCausalLM`` with a word-level tokenizer made here;
- ``lora``: PEFT's LoRA (``r=4`` on query and value) on the BERT classifier, under ``Trainer``.
"""
import argparse
import json
import os

# As many Hugging Face scripts do before anything else (alpaca-lora, TRL's examples): the world from the
# launcher's variables, e.g. to divide gradient accumulation or place a model with device_map.
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", -1))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    set_seed,
)

VOCAB = 64


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="JSON lines written by the main process")
    parser.add_argument("--output-dir", required=True, help="the Trainer's output_dir (checkpoints)")
    parser.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size")
    parser.add_argument("--resume", help="a checkpoint-N folder to resume a second run from")
    parser.add_argument("--parts", default="trainer,mean,sft,lora")
    parser.add_argument("--no-use-cpu", dest="use_cpu", action="store_false",
                        help="leave TrainingArguments(use_cpu=...) at its default")
    return parser.parse_args()


def classification(count, seed):
    """``count`` sequences of 8 token ids; the label says whether their mean is above the vocabulary's middle."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (count, 8), generator=generator)
    labels = (ids.float().mean(dim=1) > (VOCAB + 4) / 2).long()
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                              "labels": labels.tolist()})


def bert():
    set_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2))


def causal_lm():
    """A tiny ``LlamaForCausalLM`` (2 layers, hidden 32) over the 64-word vocabulary of :func:`word_tokenizer`."""
    set_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                        pad_token_id=0, bos_token_id=2, eos_token_id=3))


def arguments(options, folder, **extra):
    values = dict(output_dir=folder, per_device_train_batch_size=options.batch, per_device_eval_batch_size=4,
                  num_train_epochs=2, learning_rate=1e-3, seed=0, report_to="none", disable_tqdm=True,
                  logging_steps=4, save_strategy="no")
    if options.use_cpu:
        values["use_cpu"] = True
    values.update(extra)
    return values


def parameter_sum(model, trainable_only=False):
    return sum(p.detach().double().sum().item() for p in model.parameters()
               if p.requires_grad or not trainable_only)


def mean_loss(model, data):
    """The mean cross-entropy of ``model`` over ``data``, in plain torch in this process (not the Trainer's)."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(data["input_ids"]),
                       attention_mask=torch.tensor(data["attention_mask"])).logits
        return torch.nn.functional.cross_entropy(logits.double(), torch.tensor(data["labels"])).item()


def run_trainer(options, write):
    train, even, held_out = classification(64, 1), classification(24, 2), classification(21, 2)
    args = TrainingArguments(**arguments(options, options.output_dir, save_strategy="steps", save_steps=6))
    trainer = Trainer(model=bert(), args=args, train_dataset=train)
    result = trainer.train()
    evaluation = trainer.evaluate(even)
    prediction = trainer.predict(held_out)
    logits = torch.as_tensor(prediction.predictions, dtype=torch.float64)
    write({"part": "trainer", "world_size_variable": WORLD_SIZE, "local_rank_variable": LOCAL_RANK,
           "world_size": args.world_size, "distributed_type": str(trainer.accelerator.distributed_type),
           "accelerator": type(trainer.accelerator).__module__, "global_step": result.global_step,
           "train_loss": result.training_loss, "param_sum": parameter_sum(trainer.model),
           "eval_loss": evaluation["eval_loss"], "mean_loss": mean_loss(trainer.model, even),
           "predict_loss": prediction.metrics["test_loss"],
           "predictions_shape": list(logits.shape), "predictions_sum": logits.sum().item(),
           "checkpoints": sorted(name for name in os.listdir(options.output_dir) if name.startswith("checkpoint-"))},
          trainer)
    if options.resume:
        args = TrainingArguments(**arguments(options, options.output_dir + "-resumed"))
        trainer = Trainer(model=bert(), args=args, train_dataset=train)
        result = trainer.train(resume_from_checkpoint=options.resume)
        write({"part": "resume", "global_step": result.global_step, "param_sum": parameter_sum(trainer.model),
               "eval_loss": trainer.evaluate(even)["eval_loss"]}, trainer)


def run_mean(options, write):
    """``trainer``'s training with ``average_tokens_across_devices=False``: each process's loss is its batch's
    mean, as in one process (transformers' default multiplies it by the number of processes, see
    docs/accelerate-migration.md), so N processes x batch b can be compared with 1 process x batch N*b. The model
    is float64 here (the Trainer keeps a model's dtype without fp16/bf16), so that comparison's bound follows from
    the arithmetic: tests/launchers/test_trainer_family.py's MEAN_REL_TOL."""
    args = TrainingArguments(**arguments(options, options.output_dir + "-mean", average_tokens_across_devices=False))
    trainer = Trainer(model=bert().double(), args=args, train_dataset=classification(64, 1))
    result = trainer.train()
    even, ragged = classification(24, 2), classification(21, 2)
    write({"part": "mean", "world_size": args.world_size, "global_step": result.global_step,
           "train_loss": result.training_loss, "param_sum": parameter_sum(trainer.model),
           "eval_loss": trainer.evaluate(even)["eval_loss"], "mean_loss": mean_loss(trainer.model, even),
           "eval_loss_ragged": trainer.evaluate(ragged)["eval_loss"],
           "mean_loss_ragged": mean_loss(trainer.model, ragged)}, trainer)


def word_tokenizer():
    """A word-level tokenizer made here (no hub): ``w0`` ... ``w59`` plus four special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"] + [f"w{i}" for i in range(VOCAB - 4)]
    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]",
                                   bos_token="[BOS]", eos_token="[EOS]")


def run_sft(options, write):
    from trl import SFTConfig, SFTTrainer

    generator = torch.Generator().manual_seed(3)
    texts = []
    for _ in range(40):  # ragged lengths: the loss is a mean over tokens, not over sequences
        start, length = torch.randint(0, VOCAB - 4, (2,), generator=generator).tolist()
        texts.append(" ".join(f"w{(start + 3 * k) % (VOCAB - 4)}" for k in range(4 + length % 9)))
    model = causal_lm()
    config = SFTConfig(**arguments(options, options.output_dir + "-sft", max_length=32))
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=word_tokenizer())
    result = trainer.train()
    write({"part": "sft", "world_size": config.world_size, "global_step": result.global_step,
           "train_loss": result.training_loss, "param_sum": parameter_sum(trainer.model)}, trainer)


def run_lora(options, write):
    from peft import LoraConfig, get_peft_model

    model = bert()
    set_seed(1)
    model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0,
                                             target_modules=["query", "value"]))
    args = TrainingArguments(**arguments(options, options.output_dir + "-lora"))
    trainer = Trainer(model=model, args=args, train_dataset=classification(64, 1))
    result = trainer.train()
    write({"part": "lora", "world_size": args.world_size, "global_step": result.global_step,
           "train_loss": result.training_loss, "trainable_sum": parameter_sum(trainer.model, trainable_only=True),
           "eval_loss": trainer.evaluate(classification(21, 2))["eval_loss"]}, trainer)


def main():
    options = parse()

    def write(row, trainer):
        if trainer.is_world_process_zero():
            with open(options.out, "a") as handle:
                handle.write(json.dumps(row) + "\n")

    parts = {"trainer": run_trainer, "mean": run_mean, "sft": run_sft, "lora": run_lora}
    for name in options.parts.split(","):
        parts[name](options, write)


if __name__ == "__main__":
    main()
