"""The trackio tracker: trackio's local store; ``trackio`` is imported when the tracker opens, writes or closes
(an absolute import: this module does not stand for the library)."""
from __future__ import annotations

import os
import sys
from typing import Optional

from .base import Tracker, TrackerError


class TrackioTracker(Tracker):
    """A trackio run (``tracker``: what ``trackio.init`` returns), stored locally in
    ``project_dir/trackio`` (a SQLite file per project) unless ``TRACKIO_DIR`` says otherwise.

    trackio reads ``TRACKIO_DIR`` once per process, when it is first imported: a later start with another
    ``project_dir`` is refused in one line rather than written into the first one's store. ``TRACKIO_DIR``
    is ours only while the main process's run is open (from before the import to the close): no other rank,
    later start or child process mistakes it for the user's."""

    name, module, install = "trackio", "trackio", "pip install trackio"
    config_at_open = True
    chosen_dir: Optional[str] = None
    """The store this module gives ``TRACKIO_DIR`` while a run is open (``None``: the user's, or none yet)."""

    @classmethod
    def prepare(cls, directory: str) -> None:
        users = os.environ.get("TRACKIO_DIR") if os.environ.get("TRACKIO_DIR") != cls.chosen_dir else None
        target = os.path.abspath(users or os.path.join(directory, "trackio"))
        imported = sys.modules.get("trackio.utils")
        if imported is not None and os.path.abspath(str(imported.TRACKIO_DIR)) != target:
            raise TrackerError(
                f"trackio already stores this process's runs in {imported.TRACKIO_DIR} (it reads TRACKIO_DIR once, "
                f"at import), not {target}: give every run of the process the same project_dir")
        TrackioTracker.chosen_dir = None if users else target

    def open(self, config, kwargs):
        if self.chosen_dir is not None:
            os.environ["TRACKIO_DIR"] = self.chosen_dir
        import trackio

        return trackio.init(project=self.project or "unified_dist", config=config, **kwargs)

    logged = False
    """Whether values were logged (on every rank): trackio stores a run's config with its first log only."""

    def log(self, values, step):
        self.logged = True
        super().log(values, step)

    def check_hparams(self):
        if self.logged:
            raise TrackerError("trackio stores a run's hyper-parameters with its first log: pass them as config when "
                               "the trackers start, or log_hparams before the first log")

    def write(self, values, step):
        import trackio

        trackio.log(values, step=step)

    def write_hparams(self, flat):
        self.tracker.config.update(flat)  # carried by the first log

    def close(self, tracker):
        if tracker.config and not self.logged:  # no log carried the hyper-parameters: one empty log at step 0 does
            import trackio

            trackio.log({}, step=0)
        try:
            tracker.finish()
        finally:
            if self.chosen_dir is not None and os.environ.get("TRACKIO_DIR") == self.chosen_dir:
                del os.environ["TRACKIO_DIR"]
