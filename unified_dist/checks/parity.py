"""The comparison of ``unified-dist parity``: two or more runs of one training script, their metrics
step by step.

Each run's output folder holds a ``metrics.jsonl`` with ``{"type": "train", "step", "loss"}`` and
``{"type": "eval", "accuracy", ...}`` lines (:func:`read_metrics`); :func:`compare` gives a run's largest
relative loss difference from the reference run and its eval metrics' differences, :func:`table` the
lines the command prints. The command (:mod:`unified_dist.cli.parity`) reads ``--run``, launches the runs
and exits by :meth:`Comparison.ok`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

EVAL_KEYS = ("accuracy", "macro_f1", "eval_examples")


def read_metrics(directory: str) -> Tuple[Dict[int, float], List[dict]]:
    """(step -> training loss, eval records in order) from ``directory/metrics.jsonl``."""
    path = os.path.join(directory, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: the run failed or its script writes elsewhere")
    losses, evals = {}, []
    with open(path) as handle:
        for line in handle:
            if not line.strip():
                continue
            record = json.loads(line)
            if record.get("type") == "train" and "loss" in record:
                losses[int(record["step"])] = float(record["loss"])
            elif record.get("type") == "eval":
                evals.append(record)
    return losses, evals


@dataclass
class Comparison:
    name: str
    steps: int
    max_rel_diff: float
    at_step: Optional[int]
    missing_steps: List[int]
    eval_diffs: Dict[str, float]

    def ok(self, rtol: float, eval_atol: float) -> bool:
        return (not self.missing_steps and self.steps > 0 and self.max_rel_diff <= rtol
                and all(v <= eval_atol for v in self.eval_diffs.values()))


def compare(name: str, reference: Tuple[Dict[int, float], List[dict]],
            other: Tuple[Dict[int, float], List[dict]]) -> Comparison:
    """Largest relative loss difference over the reference's steps, and eval metric differences."""
    ref_losses, ref_evals = reference
    losses, evals = other
    missing = sorted(set(ref_losses) ^ set(losses))
    worst, at = 0.0, None
    for step in sorted(set(ref_losses) & set(losses)):
        a, b = ref_losses[step], losses[step]
        rel = abs(a - b) / max(abs(a), 1e-12)
        if at is None or rel > worst:
            worst, at = rel, step
    diffs: Dict[str, float] = {}
    if len(ref_evals) != len(evals):
        diffs["eval_count"] = float(abs(len(ref_evals) - len(evals)))
    for r, o in zip(ref_evals, evals):
        for key in EVAL_KEYS:
            if key in r and key in o:
                diffs[key] = max(diffs.get(key, 0.0), abs(float(r[key]) - float(o[key])))
    return Comparison(name, len(set(ref_losses) & set(losses)), worst, at, missing, diffs)


def table(ref_name: str, rows: List[Comparison], rtol: float, eval_atol: float) -> str:
    lines = [f"reference: {ref_name}",
             f"{'run':<16} {'steps':>5} {'max rel loss diff':>18} {'at step':>7} {'eval diffs':<40} result"]
    for row in rows:
        evals = ", ".join(f"{k} {v:.2g}" for k, v in row.eval_diffs.items()) or "-"
        extra = f" (steps only in one run: {row.missing_steps[:6]})" if row.missing_steps else ""
        verdict = "ok" if row.ok(rtol, eval_atol) else "FAIL"
        lines.append(f"{row.name:<16} {row.steps:>5} {row.max_rel_diff:>18.3e} {str(row.at_step):>7} "
                     f"{evals:<40} {verdict}{extra}")
    return "\n".join(lines)
