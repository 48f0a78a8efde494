"""What both sides of the negotiation name: Horovod's reduction op codes and the error users catch.

A leaf module: :mod:`._ops` (the operations) and :mod:`._negotiation` (the rows the ranks compare before each one)
both import it, so the negotiation can name an op and raise :class:`HorovodInternalError` without importing the
operations that import it.
"""
from __future__ import annotations

from ..errors import UnifiedDistError

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
"""Horovod's integer reduction ops (``hvd.Average``, ...), as its negotiation rows carry them."""

_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}


class HorovodInternalError(UnifiedDistError):
    """A collective failed (Horovod's name for it, a RuntimeError as there; raised where Horovod raises it)."""
