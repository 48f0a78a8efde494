"""Training-loss and validation-accuracy curves, with the final test point, from ``metrics.jsonl``
(matplotlib, Agg backend)."""
from __future__ import annotations

import json
import os
from typing import Dict, List


def read_metrics(path: str) -> List[Dict]:
    """The JSON lines of ``path`` (an unreadable trailing line, e.g. from a crash, is skipped)."""
    rows = []
    if not os.path.isfile(path):
        return rows
    with open(path) as handle:
        for line in handle:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def plot_curves(metrics_path: str, png_path: str) -> str:
    """Draw the train loss and, beside it, the validation accuracy curve with the final test accuracy
    marked as one point; write ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("type") == "train"]
    evals = [r for r in rows if r.get("type") == "eval"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1.2, label="train loss")
        ax_loss.legend()
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("cross-entropy (mean over ranks)")
    ax_loss.set_title("training loss")
    ax_loss.grid(alpha=0.3)
    validation = [r for r in evals if r.get("split") == "validation"]
    if validation:
        ax_acc.plot([r["step"] for r in validation], [r["accuracy"] for r in validation], "o-", ms=3,
                    label="validation accuracy")
    test = [r for r in evals if r.get("split") == "test"]
    if test:  # evaluated once, at the end: a point, not a curve
        final = test[-1]
        ax_acc.plot([final["step"]], [final["accuracy"]], "r*", ms=14, label="final test accuracy")
        ax_acc.annotate(f"{final['accuracy']:.3f}", (final["step"], final["accuracy"]), textcoords="offset points",
                        xytext=(-8, -16), ha="right", color="red")
    if evals:
        ax_acc.legend(loc="lower right")
    if train:
        ax_acc.set_xlim(ax_loss.get_xlim())  # same step axis as the loss
    ax_acc.set_xlabel("optimizer step")
    ax_acc.set_ylabel("accuracy")
    ax_acc.set_title("validation accuracy (test: once, at the end)")
    ax_acc.grid(alpha=0.3)
    first = rows[0] if rows else {}
    fig.suptitle(f"{first.get('launcher', '?')} / backend {first.get('backend', '?')} / "
                 f"world size {first.get('world_size', '?')}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    tmp = f"{png_path}.tmp{os.getpid()}.png"  # replaced whole: each replica group's main process writes it
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)
    return png_path
