"""The Weights & Biases tracker: an offline run by default; ``wandb`` is imported when it opens (an absolute
import: this module does not stand for the library)."""
from __future__ import annotations

import os

from .base import Tracker


class WandBTracker(Tracker):
    """A Weights & Biases run (``tracker``: the ``wandb.Run``) in ``project_dir/wandb/``, offline unless
    ``WANDB_MODE`` or ``init_kwargs={"wandb": {"mode": ...}}`` says otherwise."""

    name, module, install = "wandb", "wandb", "pip install wandb"
    config_at_open = True

    def open(self, config, kwargs):
        import wandb

        os.makedirs(self.directory, exist_ok=True)
        kwargs.setdefault("mode", os.environ.get("WANDB_MODE") or "offline")
        return wandb.init(project=self.project or "unified_dist", dir=os.path.abspath(self.directory),
                          config=config, **kwargs)

    def write(self, values, step):
        self.tracker.log(values, step=step)

    def write_hparams(self, flat):
        self.tracker.config.update(flat, allow_val_change=True)

    def close(self, tracker):
        tracker.finish()
