"""all_gather where dim 0 may differ between ranks, in one round trip when sizes repeat.

Fixed-size gathers (gloo, NCCL) need every rank's size up front, and exchanging shapes
first costs a second round trip: at small sizes that doubles the latency of every gather.
Instead each rank sends one byte row ``[header | payload | padding]`` of a *capacity* that
all ranks agree on without talking: it starts at 0 and, after every gather, becomes the
largest payload just seen (rounded up). Every rank computes it from the same gathered
headers, so the capacities never diverge. When a payload fits (the steady state: training
and evaluation gather the same sizes again and again) one gather is all it takes; when one
does not, the headers tell every rank the sizes and a second gather follows, which is what a
shape exchange would have cost anyway.

Past :data:`INLINE_LIMIT` bytes, copying the payload into the row costs more than a round
trip, so the capacity drops to 0: the first gather carries headers only, then the tensors
themselves move. Even ones in one gather, returned as a view of what the backend gathered (no
copy at all); uneven ones by one broadcast per rank straight into their slice of the result
(exact bytes, no padding, no concatenation), or, past :data:`MAX_BROADCAST_RANKS` ranks, by a
gather padded along dim 0.

The header carries each rank's shape and dtype, so mismatched trailing dims or dtypes raise
the same :class:`CollectiveError` on every rank instead of corrupting data or hanging.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from ..errors import CollectiveError

MAX_DIMS = 8
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_HEADER_WORDS = 12  # ndim, 8 dims, dtype index, payload bytes, spare: 96 bytes keeps 16-byte alignment
_HEADER_BYTES = _HEADER_WORDS * 8
_ALIGN = 64
INLINE_LIMIT = 2 << 20
"""Largest payload (bytes) sent inline with the header; larger ones take the two-gather path."""
MAX_BROADCAST_RANKS = 8
"""Up to this many ranks, a large uneven gather is one broadcast per rank instead of a padded gather."""

GatherEqual = Callable[[torch.Tensor], torch.Tensor]  # same-shape tensor on every rank -> (world, ...), rank order
Broadcast = Callable[[torch.Tensor, int], torch.Tensor]  # (tensor, src) -> src's tensor, may be in place


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class UnevenGather:
    """Stateful gatherer for one process group; call it in the same order on every rank."""

    def __init__(self, gather_equal: GatherEqual, broadcast: Optional[Broadcast] = None, rank: int = 0) -> None:
        self._gather_equal = gather_equal
        self._broadcast = broadcast
        self._rank = rank
        self.capacity = 0  # payload bytes per rank in the next first-try gather (same on all ranks)

    def parts(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        """Every rank's ``tensor`` (at least 1-d, contiguous, on the group's device), in rank order."""
        return self._gather(tensor)[0]

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 in rank order (a new tensor)."""
        parts, joined = self._gather(tensor)
        return joined if joined is not None else torch.cat(parts)

    def _gather(self, tensor: torch.Tensor) -> Tuple[List[torch.Tensor], Optional[torch.Tensor]]:
        """(per-rank parts, their concatenation when it came for free, else None)."""
        if tensor.dim() > MAX_DIMS:
            raise CollectiveError(f"all_gather supports up to {MAX_DIMS} dimensions, got shape {tuple(tensor.shape)}")
        if tensor.dtype not in _DTYPES:
            raise CollectiveError(f"all_gather does not support dtype {tensor.dtype}; cast to one of the usual dtypes")
        payload = tensor.reshape(-1).view(torch.uint8)
        nbytes = payload.numel()
        header = _header(tensor, nbytes)

        capacity = self.capacity
        inline = nbytes <= capacity
        pieces = [header.to(tensor.device), payload] if inline else [header.to(tensor.device)]
        spare = capacity - (nbytes if inline else 0)
        if spare:
            pieces.append(torch.zeros(spare, dtype=torch.uint8, device=tensor.device))
        row = torch.cat(pieces)
        rows = self._gather_equal(row)
        headers = rows[:, :_HEADER_BYTES].cpu().contiguous().view(torch.int64).tolist()
        shapes, dtype, sizes = _check(headers)
        needed = max(sizes)
        self.capacity = _round_up(needed) if needed <= INLINE_LIMIT else 0
        if needed <= capacity:  # everyone's payload came inline
            return [rows[r, _HEADER_BYTES:_HEADER_BYTES + n].view(dtype).view(shape)
                    for r, (shape, n) in enumerate(zip(shapes, sizes))], None
        if needed <= INLINE_LIMIT:  # resend inline at the new capacity
            row = torch.zeros(self.capacity, dtype=torch.uint8, device=tensor.device)
            row[:payload.numel()] = payload
            rows = self._gather_equal(row)
            return [rows[r, :n].view(dtype).view(shape) for r, (shape, n) in enumerate(zip(shapes, sizes))], None
        # large: move the tensors themselves
        lengths = [shape[0] for shape in shapes]
        longest = max(lengths)
        if min(lengths) != longest and self._broadcast is not None and len(lengths) <= MAX_BROADCAST_RANKS:
            out = tensor.new_empty((sum(lengths),) + tuple(tensor.shape[1:]))
            parts, offset = [], 0
            for src, n in enumerate(lengths):
                part = out[offset:offset + n]
                if src == self._rank:
                    part.copy_(tensor)
                if n:
                    moved = self._broadcast(part, src)
                    if moved.data_ptr() != part.data_ptr():
                        part.copy_(moved)
                parts.append(part)
                offset += n
            return parts, out
        if tensor.shape[0] < longest:
            tensor = torch.cat([tensor, tensor.new_zeros((longest - tensor.shape[0],) + tuple(tensor.shape[1:]))])
        stacked = self._gather_equal(tensor)  # (world, longest, *trailing)
        parts = [stacked[r, :n] for r, n in enumerate(lengths)]
        even = min(lengths) == longest
        return parts, stacked.reshape((-1,) + tuple(tensor.shape[1:])) if even else None


def _header(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """This rank's header as bytes: ndim, dims (padded with -1), dtype index, payload bytes."""
    dims = list(tensor.shape)
    return torch.tensor([len(dims), *dims, *[-1] * (MAX_DIMS - len(dims)), _DTYPES.index(tensor.dtype), nbytes, -1],
                        dtype=torch.int64).view(torch.uint8)


def shape_mismatch_error(gather_equal: GatherEqual, tensor: torch.Tensor) -> CollectiveError:
    """After a gather failed on mismatched shapes: the error naming every rank's shape (all ranks call it)."""
    rows = gather_equal(_header(tensor, tensor.numel() * tensor.element_size()).to(tensor.device))
    try:
        _check(rows.cpu().contiguous().view(torch.int64).tolist())
    except CollectiveError as exc:
        return exc
    return CollectiveError(f"all_gather failed on rank shapes that look compatible ({tuple(tensor.shape)} here)")


def _check(headers: List[List[int]]) -> Tuple[List[tuple], torch.dtype, List[int]]:
    """Shapes, the common dtype and payload sizes from every rank's header; mismatch -> error."""
    shapes = [tuple(h[1:h[0] + 1]) for h in headers]
    dtypes = [_DTYPES[h[MAX_DIMS + 1]] for h in headers]
    if len({s[1:] for s in shapes}) != 1 or len(set(dtypes)) != 1:
        per_rank = ", ".join(f"rank {r}: {s}" + ("" if len(set(dtypes)) == 1 else f" {str(d).replace('torch.', '')}")
                             for r, (s, d) in enumerate(zip(shapes, dtypes)))
        raise CollectiveError(f"all_gather needs the same shape on every rank except dim 0, and the same dtype, "
                              f"got {per_rank}; pad, reshape or cast before gathering")
    return shapes, dtypes[0], [h[MAX_DIMS + 2] for h in headers]
