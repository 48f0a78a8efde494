"""``hvd.DistributedOptimizer``: the given optimizer's class, averaging gradients as Horovod's does.

Contract (Horovod 0.28.1's):
- the result is an instance of a subclass of ``type(optimizer)`` built on its ``param_groups`` (the same
  group dicts: a scheduler of the original drives it) with fresh state;
- each parameter's gradient is reduced (``op``, default ``Average``) as soon as backward has
  accumulated it ``backward_passes_per_step`` times: the passes before only accumulate locally, and the
  reduced value is the op over ranks of the *sum* of those passes (not their mean);
- ``step()`` first waits for every reduction (``synchronize()``), reducing now the gradients backward
  never reached (zeros where there was none); after an explicit ``synchronize()``, ``step()`` inside
  ``skip_synchronize()`` does not reduce again;
- a rank in ``hvd.join()`` answers the others' reductions with zeros (``Average`` still divides by the
  set's size), so ranks with fewer batches join while the others step on, each keeping its own weights;
- ``gradient_predivide_factor`` f (``Average`` only) scales by 1/f before the sum and f/size after;
- ``compression`` decides what travels (``Compression.fp16``: float16);
- ``zero_grad()`` between a backward and the step raises, as Horovod's does;
- with one process nothing is reduced.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from . import _ops
from ._ops import Average, global_process_set, resolve_op, synchronize
from .compression import Compression


class _Averaging:
    """Mixed in before the user's optimizer class (see :func:`DistributedOptimizer`)."""

    def __init__(self, params: Any, named_parameters: Any, compression: Any, backward_passes_per_step: int,
                 op: int, gradient_predivide_factor: float, process_set: Any, sparse_as_dense: bool) -> None:
        super().__init__(params)  # the user's class, on the original param group dicts
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._sparse: set = set()  # parameters whose sparse gradient travels dense
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.process_set = process_set
        self._parameter_names = _names_of(self.param_groups, named_parameters)
        self._delay = {p: backward_passes_per_step for p in self._parameter_names}
        self._handles: Dict[torch.Tensor, Tuple[Optional[int], Any]] = {}
        self._order: List[torch.Tensor] = []  # the one order in which every rank sends its gradients
        self._ready: set = set()  # accumulated backward_passes_per_step times, waiting for their turn
        self._sent = 0  # how many of _order this step has sent
        self._specs: List[Tuple[int, ...]] = []  # what this step's reductions put on the wire, in order
        self._synchronized = False
        self._should_synchronize = True
        if process_set.included() and _ops._world.size > 1:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.requires_grad:
                        self._order.append(p)
                        p.register_post_accumulate_grad_hook(self._make_hook())
            self._order.reverse()  # backward usually reaches the last parameters first
        self._requires_update = set(self._order)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate locally before a reduction."""
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def _make_hook(self) -> Any:
        def hook(p: torch.Tensor) -> None:
            if self._delay[p] <= 0:
                raise AssertionError("Gradients were computed more than backward_passes_per_step times before "
                                     "call to step(). Increase backward_passes_per_step to accumulate gradients "
                                     "locally.")
            self._delay[p] -= 1
            self._handles.setdefault(p, (None, None))  # zero_grad() now refuses, as Horovod's does
            if self._delay[p] == 0:
                self._ready.add(p)
                self._send_ready()
        return hook

    def _send_ready(self) -> None:
        """Send the ready gradients that are next in :attr:`_order`: every rank sends in that one order
        (torch.distributed pairs collectives by order), also when their backward passes reach the
        parameters in different orders or not at all (those wait for :meth:`synchronize`)."""
        while self._sent < len(self._order) and self._order[self._sent] in self._ready:
            p = self._order[self._sent]
            self._handles[p] = self._start(p)
            self._sent += 1

    def _start(self, p: torch.Tensor) -> Tuple[int, Any]:
        if p.grad is None:
            p.grad = torch.zeros_like(p.data)
        if p.grad.is_sparse:
            if not self._sparse_as_dense:
                from ._extras import sparse_allreduce_async

                return sparse_allreduce_async(p.grad, None, self.op, self.process_set), None
            p.grad = p.grad.to_dense()
            self._sparse.add(p)
        wire, ctx = self._compression.compress(p.grad)
        pre, post = ((1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor)
                     if self.op == Average else (1.0, 1.0))
        handle, spec = _ops.gradient_allreduce_async_(wire, self.op, pre, post, self.process_set)
        if spec is not None:
            self._specs.append(spec)
        return handle, ctx

    def synchronize(self) -> None:
        """Finish every gradient reduction (starting those not started) and put the results in ``.grad``."""
        if not self.process_set.included():
            self._synchronized = True
            return
        for p in self._order[self._sent:]:  # in order; zeros for a gradient this rank never computed
            self._handles[p] = self._start(p)
        _ops.gradient_step(self._specs, self.op, self.process_set)  # a member in hvd.join() answers them
        for p in self._order:
            handle, ctx = self._handles[p]
            self._delay[p] = self.backward_passes_per_step
            if callable(handle):  # a sparse gradient's reduction (sparse_allreduce_async)
                p.grad.zero_().add_(handle())
                continue
            p.grad.set_(self._compression.decompress(synchronize(handle), ctx))
            if p in self._sparse:  # back to the layout the optimizer expects (SparseAdam)
                p.grad = p.grad.to_sparse()
        self._forget_step()
        self._synchronized = True

    def _forget_step(self) -> None:
        self._handles.clear()
        self._ready.clear()
        self._specs = []
        self._sent = 0

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside, ``step()`` does not reduce (use after an explicit :meth:`synchronize`)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(): the gradients are reduced twice. Wrap step() in "
                              "optimizer.skip_synchronize() after synchronize().", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def _local_step(self) -> Any:
        """The wrapped class's step, reducing nothing (``broadcast_optimizer_state`` on empty state)."""
        return super().step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                                 "cause a race condition.")
        super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._forget_step()
        self._synchronized = False
        self._should_synchronize = True
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        super().load_state_dict(state_dict)


def _names_of(param_groups: Any, named_parameters: Any) -> Dict[torch.Tensor, str]:
    """Each parameter's name; refuses duplicates and parameters left unnamed, as Horovod does."""
    if named_parameters is None:
        named = [(f"allreduce.noname.{i}.{j}", p)
                 for i, g in enumerate(param_groups) for j, p in enumerate(g["params"])]
    else:
        named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                         "model.named_parameters().")
    keys = [k for k, _ in named]
    dups = sorted({k for k in keys if keys.count(k) > 1})
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    unnamed = {id(p) for g in param_groups for p in g["params"]} - {id(p) for _, p in named}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         f"Python object ids: {', '.join(map(str, sorted(unnamed)))}")
    return {p: k for k, p in sorted(named, key=lambda item: item[0])}


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,  # noqa: N802 - Horovod's
                         compression: Any = Compression.none, backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                         sparse_as_dense: bool = False, process_set: Any = global_process_set) -> Any:
    """``optimizer`` made to reduce gradients across ranks before each step (module docstring).

    ``groups``/``num_groups`` (Horovod's fused groups) only change how Horovod batches its messages,
    not the result: accepted and ignored. Sparse gradients are gathered (``sparse_allreduce_async``), or
    reduced dense with ``sparse_as_dense=True``."""
    op = resolve_op(op, None)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    base = optimizer.__class__
    cls = type(base.__name__, (_Averaging, base), {"__module__": __name__})
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, process_set, sparse_as_dense)
