"""Horovod's gradient compression (``hvd.Compression``): a compressor turns a tensor into what travels
(``compress(tensor) -> (wire, ctx)``) and back (``decompress(wire, ctx)``). The interface is Horovod's,
so these compressors also work inside real Horovod's ``DistributedOptimizer`` and ``allreduce``."""
from __future__ import annotations

from typing import Any, Tuple

import torch


class Compressor:
    """Interface: ``compress`` returns the tensor to send and what ``decompress`` needs to undo it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends the tensor as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating tensors as float16 and casts the result back to their dtype; other dtypes as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        wire = tensor.to(torch.float16) if tensor.dtype.is_floating_point else tensor
        return wire, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx.is_floating_point else tensor


class Compression:
    """The compressors by name: ``Compression.none`` (default) and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
