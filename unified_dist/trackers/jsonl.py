"""The JSONL tracker: ``metrics.jsonl`` and ``hparams.json`` in ``project_dir/project_name``; it needs no library."""
from __future__ import annotations

import json
import os
from typing import Any, Dict

from .base import Tracker


class JsonlTracker(Tracker):
    """``metrics.jsonl`` (one line per :meth:`log`: ``{"step": s, **values}``) and ``hparams.json``;
    ``tracker`` is the open ``metrics.jsonl`` (its ``.name`` is the path)."""

    name = "jsonl"

    def open(self, config, kwargs):
        handle = open(os.path.join(self.folder, "metrics.jsonl"), "a", **kwargs)
        self.hparams: Dict[str, Any] = {}
        self.write_hparams_to = os.path.join(self.folder, "hparams.json")
        return handle

    def write(self, values, step):
        self.tracker.write(json.dumps({"step": step, **values}) + "\n")
        self.tracker.flush()

    def write_hparams(self, flat):
        self.hparams.update(flat)
        with open(self.write_hparams_to, "w") as handle:
            json.dump(self.hparams, handle, indent=1)

    def close(self, tracker):
        tracker.close()
