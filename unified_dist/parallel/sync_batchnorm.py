"""Synchronised BatchNorm that runs on any device and backend, over collectives it is given.

torch's ``SyncBatchNorm`` refuses CPU modules and Accelerate leaves BatchNorm to the user; this
module computes a training step's batch statistics over the *global* batch:

- forward: each rank contributes ``(count, mean, M2)`` per channel of its local batch; one
  ``all_gather`` and Chan's parallel-variance merge give the global mean and (biased) variance,
  exactly as one process computes them on the concatenated batch, uneven per-rank batch sizes
  (zero included) weighted by their counts.
- backward: the gather is differentiable (its gradient is the all-reduced sum of the gathered
  rows' gradients, each rank keeping its own row), so the input gradient has both of
  BatchNorm's cross-sample terms from the whole global batch, as torch's CUDA kernel computes.
- running statistics follow ``torch.nn.BatchNorm``: momentum (or the cumulative average when
  ``momentum=None``) and the unbiased variance of the global batch.
- evaluation (or ``track_running_stats`` with ``eval()``) uses the running statistics with no
  communication, and a world of one is plain BatchNorm.

The state dict keeps BatchNorm's keys (``weight``, ``bias``, ``running_mean``, ``running_var``,
``num_batches_tracked``), so a checkpoint loads into the unconverted model and back.
Every rank must run the same BatchNorm layers in the same order (as with every collective).

This module imports nothing of unified_dist: :func:`portable` takes the gather, the sum and the
rank and world size as functions (the backend's :meth:`~unified_dist.backends.Backend.convert_sync_batchnorm`
gets them from the session, which builds them on :mod:`unified_dist.collectives.ops`). A
:class:`SyncBatchNorm` given none is a world of one: plain BatchNorm.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.nn.modules.batchnorm import _BatchNorm

Gather = Callable[[torch.Tensor], torch.Tensor]
"""Every rank's tensor concatenated along dim 0, in rank order."""
ReduceSum = Callable[[torch.Tensor], torch.Tensor]
"""The sum of every rank's tensor."""
RankWorld = Callable[[], "tuple[int, int]"]
"""This process's rank and the world size."""


class _GatherRows(torch.autograd.Function):
    """``gather(row)`` -> ``[world, ...]`` with the gradient of a gather: all-reduce, keep own row."""

    @staticmethod
    def forward(ctx: Any, row: torch.Tensor, gather: Gather, reduce_sum: ReduceSum, rank: int) -> torch.Tensor:
        ctx.reduce_sum, ctx.rank = reduce_sum, rank
        return gather(row.unsqueeze(0))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return ctx.reduce_sum(grad.contiguous())[ctx.rank], None, None, None


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the batch statistics and the normalisation are computed in: float32 for bf16 and
    fp16 inputs (as torch's BatchNorm kernels), the input's own dtype when it is wider (a float64
    model keeps float64 statistics, as plain BatchNorm and a world of one do)."""
    return torch.promote_types(dtype, torch.float32)


def global_moments(x: torch.Tensor, gather: Gather, reduce_sum: ReduceSum, rank: int):
    """``(mean, biased var, count)`` per channel (dim 1) of ``x`` over every rank's batch, in
    :func:`statistics_dtype` of ``x``."""
    channels = x.shape[1]
    flat = x.transpose(0, 1).reshape(channels, -1).to(statistics_dtype(x.dtype))
    count = flat.shape[1]
    mean = flat.mean(dim=1) if count else flat.new_zeros(channels)
    m2 = ((flat - mean[:, None]) ** 2).sum(dim=1)
    row = torch.cat([flat.new_full((1,), float(count)), mean, m2])
    rows = _GatherRows.apply(row, gather, reduce_sum, rank)
    counts, means, m2s = rows[:, :1], rows[:, 1:1 + channels], rows[:, 1 + channels:]
    total = counts.sum()
    if total.item() == 0:
        raise ValueError("SyncBatchNorm got an empty batch on every rank")
    global_mean = (counts * means).sum(dim=0) / total
    global_m2 = (m2s + counts * (means - global_mean) ** 2).sum(dim=0)
    return global_mean, global_m2 / total, int(total.item())


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of a data-parallel job; see the module docstring."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.gather: Optional[Gather] = None
        self.reduce_sum: Optional[ReduceSum] = None
        self.rank_world: RankWorld = _alone

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        rank, world = self.rank_world()
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or world == 1:
            return super().forward(input)
        mean, var, total = global_moments(input, self.gather, self.reduce_sum, rank)
        if self.training and self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), total)
        shape = (1, -1) + (1,) * (input.dim() - 2)
        out = (input.to(mean.dtype) - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, total: int) -> None:
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (total / (total - 1)) if total > 1 else var
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


def _alone() -> "tuple[int, int]":
    """A world of one: what a :class:`SyncBatchNorm` that was given no collectives computes over."""
    return 0, 1


def convert(module: torch.nn.Module, make: Callable[[_BatchNorm], torch.nn.Module]) -> torch.nn.Module:
    """Replace every ``BatchNorm1d/2d/3d`` in ``module`` by ``make(bn)`` (which must keep its
    parameters and buffers under the same names); returns ``module`` (or its replacement)."""
    if isinstance(module, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)):
        return make(module)
    for name, child in module.named_children():
        replaced = convert(child, make)
        if replaced is not child:
            setattr(module, name, replaced)
    return module


def sharing(cls: Callable[..., _BatchNorm]) -> Callable[[_BatchNorm], _BatchNorm]:
    """A :func:`convert` factory: ``cls`` (a BatchNorm-like class) built with a BatchNorm's settings,
    sharing its parameters and buffers (no copies), in its training mode."""
    def make(bn: _BatchNorm) -> _BatchNorm:
        sync = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
        for name, value in list(bn._parameters.items()) + list(bn._buffers.items()):
            setattr(sync, name, value)
        sync.train(bn.training)
        return sync
    return make


portable_from = sharing(SyncBatchNorm)
"""A :class:`SyncBatchNorm` sharing a BatchNorm's parameters and buffers, with no collectives yet."""


def portable(gather: Gather, reduce_sum: ReduceSum, rank_world: RankWorld) -> Callable[[_BatchNorm], _BatchNorm]:
    """A :func:`convert` factory: :data:`portable_from`, communicating through the functions given."""
    def make(bn: _BatchNorm) -> _BatchNorm:
        sync = portable_from(bn)
        sync.gather, sync.reduce_sum, sync.rank_world = gather, reduce_sum, rank_world
        return sync
    return make
