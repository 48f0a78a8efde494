"""Tests of the ``unified-dist`` command (a package, so its module names don't clash with tests/)."""
