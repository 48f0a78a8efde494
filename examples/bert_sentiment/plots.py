"""Training-loss and evaluation-accuracy curves from ``metrics.jsonl`` (matplotlib, Agg backend)."""
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
    """Draw the train loss per logged step and the eval accuracy per split; write ``png_path``."""
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
    for split, style in (("validation", "s--"), ("test", "o-")):
        points = [r for r in evals if r.get("split", "test") == split]
        if points:
            ax_acc.plot([r["step"] for r in points], [r["accuracy"] for r in points], style, label=f"{split} accuracy")
    if evals:
        ax_acc.legend()
    if train:
        ax_acc.set_xlim(ax_loss.get_xlim())  # same step axis as the loss
    ax_acc.set_xlabel("optimizer step")
    ax_acc.set_ylabel("accuracy")
    ax_acc.set_title("evaluation")
    ax_acc.grid(alpha=0.3)
    first = rows[0] if rows else {}
    fig.suptitle(f"{first.get('launcher', '?')} / backend {first.get('backend', '?')} / "
                 f"world size {first.get('world_size', '?')}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)
    return png_path
