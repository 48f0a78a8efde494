"""Several whole runs of examples/bert_sentiment/train.py's ``main()`` in one launch, one after the other in the
same processes (tests/examples/test_bert_hotpath.py): the runs share the launcher's start and the imports, which
on 2 cores cost more than the runs of the tests' BERT themselves, as bench/streaming/streaming_worker.py's
configurations share theirs.

    torchrun --standalone --nproc_per_node 2 tests/examples/runs_in_one_launch.py PLAN.json

PLAN.json is a list of ``{"name": ..., "argv": [...], "env": {...}, "snapshot": PATH}``. Before each run the worker
sets ``env`` in ``os.environ`` (e.g. each run's own TORCHINDUCTOR_CACHE_DIR: torch reads it when it compiles), and
rank 0 prints ``MARKER + name`` on its standard output: what the example prints (``ud.print``, rank 0 only) after
that line and before the next marker is that run's. Each run is ``ud.init`` .. ``ud.shutdown`` (train.py's own); the
launch fails with the first run that does. ``snapshot`` (optional): after the run, rank 0 writes there what its
``--output-dir`` then held (:func:`snapshot`), before a later run of the plan changes it (a stopped run that the
next one continues in the same folder).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "bert_sentiment" / "train.py"
MARKER = "=== run: "


def split_output(output: str) -> dict:
    """A launch's output by run name (the text after each run's marker, up to the next marker)."""
    parts = output.split(MARKER)[1:]
    return {part.split("\n", 1)[0].strip(): part.split("\n", 1)[-1] for part in parts}


def launch_plan(launcher: str, plan: list, folder: Path, nproc: int, timeout: float, env=None):
    """Write ``plan`` to ``folder``/plan.json and run it in one launch of this worker (the tests' side): the launch's
    ``Result`` and each run's own part of its output (:func:`split_output`)."""
    from unified_dist.testing.launchers import launch

    (folder / "plan.json").write_text(json.dumps(plan))
    result = launch(launcher, __file__, [str(folder / "plan.json")], nproc=nproc, timeout=timeout, env=env)
    return result, split_output(result.output)


def snapshot(out: Path) -> dict:
    """What ``out`` holds: its metrics.jsonl's lines (``rows``) and its files, relative to it (``files``)."""
    metrics = out / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    return {"rows": rows, "files": sorted(str(path.relative_to(out)) for path in out.rglob("*"))}


def main() -> int:
    plan = json.loads(Path(sys.argv[1]).read_text())
    spec = importlib.util.spec_from_file_location("bert_sentiment_train", TRAIN)
    train = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = train
    spec.loader.exec_module(train)  # it puts its own folder on sys.path
    for entry in plan:
        os.environ.update(entry.get("env", {}))
        if os.environ.get("RANK", "0") == "0":
            print(f"{MARKER}{entry['name']}", flush=True)
        code = train.main(entry["argv"])
        if code != 0:
            print(f"runs_in_one_launch: {entry['name']} exited with {code}", file=sys.stderr, flush=True)
            return code
        if entry.get("snapshot") and os.environ.get("RANK", "0") == "0":
            out = Path(entry["argv"][entry["argv"].index("--output-dir") + 1])
            Path(entry["snapshot"]).write_text(json.dumps(snapshot(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
