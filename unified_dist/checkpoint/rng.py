"""Capture and restore this process's random number generators as checkpoint-safe state.

Only tensors, ints, strings and tuples: loadable with ``torch.load(weights_only=True)``.
:data:`RNG` stands for the generators in a checkpoint's state dict (``{"model": model, ...,
"rng": ud.RNG}``): ``ud.save`` writes every rank's states there, ``ud.load(path, state)`` restores
this rank's.
"""
from __future__ import annotations

import random
from typing import Any, Dict

import torch


class _RNG:
    """The type of :data:`RNG` (one instance; compare with ``is``)."""

    def __repr__(self) -> str:
        return "ud.RNG"

    def __reduce__(self) -> str:
        return "RNG"  # a copy (deepcopy, pickle) is the same marker


RNG = _RNG()
"""A value in the state dict given to ``ud.save``/``ud.save_checkpoint`` and ``ud.load(path, state)``
that stands for the random number generators (python, numpy, torch, CUDA). ``save`` writes every
rank's states in its place (in rank order: a collective, so every rank must call that save);
``load(path, state)`` restores this rank's (rank r takes ``states[r % len(states)]``, as
``ud.restore_rng_states`` does), and the marker stays in ``state`` for the next save."""


def capture() -> Dict[str, Any]:
    """The python, numpy (if installed), torch CPU and CUDA generator states of this process."""
    version, internal, gauss = random.getstate()
    state: Dict[str, Any] = {"python": (version, torch.tensor(internal, dtype=torch.int64), gauss),
                             "torch": torch.get_rng_state()}
    try:
        import numpy

        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: Dict[str, Any]) -> None:
    """Put the generators back exactly as :func:`capture` saw them."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(int(v) for v in internal.tolist()), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
