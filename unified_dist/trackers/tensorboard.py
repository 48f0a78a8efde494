"""The TensorBoard tracker: ``torch.utils.tensorboard``'s ``SummaryWriter``, imported when it opens."""
from __future__ import annotations

import os

from .base import Tracker


class TensorBoardTracker(Tracker):
    """A ``torch.utils.tensorboard.SummaryWriter`` on ``project_dir/project_name`` (or init_kwargs'
    ``log_dir``): numbers as scalars, strings as text, hyper-parameters in the HParams plugin (in the same
    event file)."""

    name, module, install = "tensorboard", "tensorboard", "pip install tensorboard"

    def open(self, config, kwargs):
        from torch.utils.tensorboard import SummaryWriter

        kwargs.setdefault("log_dir", os.path.join(self.directory, self.project))  # init_kwargs may name another
        return SummaryWriter(**kwargs)

    def write(self, values, step):
        for key, value in values.items():
            if isinstance(value, str):
                self.tracker.add_text(key, value, step)
            else:
                self.tracker.add_scalar(key, value, step)
        self.tracker.flush()

    def write_hparams(self, flat):
        from torch.utils.tensorboard.summary import hparams

        self.hparams = {**getattr(self, "hparams", {}), **flat}  # TensorBoard shows one session's: all of them
        for summary in hparams(self.hparams, {}):  # experiment, session start, session end
            self.tracker.file_writer.add_summary(summary)
        self.tracker.flush()

    def close(self, tracker):
        tracker.close()
