"""Moved to :mod:`unified_dist.testing.launchers`, which the tests and bench/ import.

This name stays only for test_checkpoint.py, test_settings.py and test_launch_from_python.py, which
still say ``from launchers import ...``; delete it once they import from unified_dist.testing.
"""
from unified_dist.testing.launchers import BIN, ROOT, child_env, run  # noqa: F401
