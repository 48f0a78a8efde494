"""A checkpoint directory that DeepSpeed's own ``engine.save_checkpoint(dir)`` wrote (a plain DeepSpeed script's),
read as portable state: the model's float32 weights by parameter name, assembled by DeepSpeed's own
``deepspeed.utils.zero_to_fp32`` from the ZeRO partitions of every rank (stages 1-3), on one process, without a
process group. DeepSpeed's files hold pickled objects (its config, its optimizer's class), which DeepSpeed unpickles:
read only directories you trust. The optimizer's state stays in DeepSpeed's flat layout: not read here.
"""
from __future__ import annotations

import os
from typing import Dict

import torch

from ..errors import CheckpointError, first_line

LATEST = "latest"
"""The file in which ``engine.save_checkpoint`` names its newest tag (its ``save_latest=True``, the default)."""


def holds_one(path: str) -> bool:
    """Whether ``path`` is a directory DeepSpeed's ``engine.save_checkpoint`` wrote (it names its newest tag)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, LATEST))


def read_weights(path: str) -> Dict[str, torch.Tensor]:
    """The model's full float32 state dict from the DeepSpeed checkpoint directory ``path`` (its newest tag);
    one actionable line when DeepSpeed is missing or cannot read it."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as exc:
        raise CheckpointError(f"{path} is a DeepSpeed checkpoint directory, and reading it needs the deepspeed package "
                              f"({first_line(exc)}): install it with `make setup`") from None
    try:
        weights = get_fp32_state_dict_from_zero_checkpoint(path)
    except Exception as exc:  # DeepSpeed's own errors take many forms (asserts, ValueErrors, missing files)
        raise CheckpointError(
            f"DeepSpeed could not read {path} as a ZeRO checkpoint ({first_line(exc)}); it reads directories "
            "that engine.save_checkpoint wrote under ZeRO stages 1-3") from None
    return {name: tensor.detach().cpu() for name, tensor in weights.items()}
