"""The one error the command line raises on purpose."""
from __future__ import annotations

from ..errors import UnifiedDistError


class UsageError(UnifiedDistError):
    """A command line that cannot run on this machine (bad value, missing launcher or script).

    ``main`` prints it as one line on stderr and exits with status 2, like argparse's own errors.
    """
