"""Horovod's differentiable collectives (``hvd.allreduce``, ``allgather``, ``broadcast``, ``alltoall``,
``reducescatter`` and their ``grouped_`` forms) over :mod:`unified_dist.horovod._ops`.

The gradients are Horovod's: an allreduce's is the same allreduce of the incoming gradient; an
allgather's is the *average* over members of the incoming gradient, cut to this rank's rows; a
broadcast's is that average on the root and zero elsewhere; an alltoall's is the alltoall back; a
reduce-scatter's is the allgather of the incoming gradient (times the set's size for ``Sum``, times
the scale factors).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from . import _ops
from ._ops import Average, ProcessSet, Sum, global_process_set, synchronize
from .compression import Compression


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, pre: float, post: float, ps: ProcessSet) -> torch.Tensor:
        ctx.args = (op, pre, post, ps)
        return synchronize(_ops.allreduce_async(tensor, None, None, op, pre, post, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        return _Allreduce.apply(grad, op, pre, post, ps), None, None, None, None


@_ops._refused_before_sending(unnamed=True)
def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Optional[int] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced across ``process_set`` (``Average`` by default), sent through
    ``compression``; the input is not modified. Differentiable."""
    resolved = _ops.resolve_op(op, average)
    wire, ctx = compression.compress(tensor)
    return compression.decompress(_Allreduce.apply(wire, resolved, prescale_factor, postscale_factor, process_set),
                                  ctx)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: int, pre: float, post: float, ps: ProcessSet, *tensors: torch.Tensor) -> Any:
        ctx.args = (op, pre, post, ps)
        return tuple(synchronize(_ops.grouped_allreduce_async(list(tensors), None, None, op, pre, post, ps)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        return (None, None, None, None) + tuple(_GroupedAllreduce.apply(op, pre, post, ps, *grads))


@_ops._refused_before_sending(unnamed=True)
def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                      compression: Any = Compression.none, op: Optional[int] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list:
    """:func:`allreduce` of each tensor of ``tensors``, as one operation; a list. Differentiable."""
    resolved = _ops.resolve_op(op, average)
    packed = [compression.compress(t) for t in tensors]
    out = _GroupedAllreduce.apply(resolved, prescale_factor, postscale_factor, process_set, *[w for w, _ in packed])
    return [compression.decompress(t, c) for t, (_, c) in zip(out, packed)]


def _own_rows(grad: torch.Tensor, length: int, ps: ProcessSet) -> torch.Tensor:
    """This member's rows of an allgather's (averaged) gradient."""
    lengths = synchronize(_ops.allgather_async(torch.tensor([length], dtype=torch.int64), process_set=ps))
    index = ps.ranks.index(_ops._world.rank)
    start = int(lengths[:index].sum()) if index else 0
    return grad.narrow(0, start, length)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, ps: ProcessSet) -> torch.Tensor:
        ctx.length, ctx.ps, ctx.zero_d = (tensor.shape[0] if tensor.dim() else 1), ps, tensor.dim() == 0
        return synchronize(_ops.allgather_async(tensor, process_set=ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        mean = allreduce(grad, op=Average, process_set=ctx.ps)
        rows = _own_rows(mean, ctx.length, ctx.ps)
        return (rows.reshape(()) if ctx.zero_d else rows), None


@_ops._refused_before_sending(unnamed=True)
def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every member's ``tensor`` concatenated along dim 0 in rank order (dim 0 may differ per rank; a
    0-d tensor counts as one row); the input is not modified. Differentiable."""
    return _Allgather.apply(tensor, process_set)


@_ops._refused_before_sending(unnamed=True)
def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list:
    """:func:`allgather` of each tensor; a list. Differentiable."""
    return [_Allgather.apply(t, process_set) for t in tensors]


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, ps: ProcessSet) -> torch.Tensor:
        ctx.root, ctx.ps = root, ps
        return synchronize(_ops.broadcast_async(tensor, root, process_set=ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        mean = allreduce(grad, op=Average, process_set=ctx.ps)
        return (mean if _ops._world.rank == ctx.root else mean * 0), None, None


@_ops._refused_before_sending(unnamed=True)
def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor holding global rank ``root_rank``'s ``tensor``; the input is not modified. Differentiable."""
    return _Broadcast.apply(tensor, root_rank, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, ps: ProcessSet) -> Any:
        out, received = synchronize(_ops.alltoall_async(tensor, splits, process_set=ps))
        ctx.received, ctx.ps = received, ps
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> Any:
        back, _ = _Alltoall.apply(grad.contiguous(), ctx.received, ctx.ps)
        return back, None, None


@_ops._refused_before_sending(unnamed=True)
def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` to member ``i`` (equal parts without ``splits``); returns the
    rows received in member order, and, when ``splits`` was given, the int32 counts received from each.
    The input is not modified. Differentiable."""
    out, received = _Alltoall.apply(tensor, splits, process_set)
    return out if splits is None else (out, received)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, ps: ProcessSet, pre: float, post: float) -> torch.Tensor:
        ctx.args = (op, ps, pre, post)
        return synchronize(_ops.reducescatter_async(tensor, None, op, ps, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, ps, pre, post = ctx.args
        factor = (len(ps.ranks) if op == Sum else 1) * pre * post
        return allgather(grad * factor if factor != 1 else grad, process_set=ps), None, None, None, None


@_ops._refused_before_sending(unnamed=True)
def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression: Any = Compression.none,
                  op: int = Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """``tensor`` reduced across members (``Average`` or ``Sum``), each keeping its part of dim 0 (equal
    parts, the first ``dim0 % size`` members one row more); the input is not modified. Differentiable."""
    resolved = _ops.resolve_op(op, None)
    wire, ctx = compression.compress(tensor)
    return compression.decompress(_Reducescatter.apply(wire, resolved, process_set, prescale_factor,
                                                       postscale_factor), ctx)


@_ops._refused_before_sending(unnamed=True)
def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Any = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list:
    """:func:`reducescatter` of each tensor; a list. Differentiable."""
    return [reducescatter(t, None, compression, op, process_set, prescale_factor, postscale_factor)
            for t in tensors]
