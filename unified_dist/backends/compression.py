"""Gradient compression: send gradients over the wire in 16 bits, halving the bytes per step.

What ``gradient_compression="bf16"|"fp16"`` means (``ud.init(gradient_compression=...)``,
``UNIFIED_DIST_GRADIENT_COMPRESSION``, ``unified-dist launch --gradient-compression``):
each rank's gradient is rounded to the format before it is averaged, the average is computed
in that format, and the result is widened back into the float32 gradient the optimizer reads.
Parameters, optimizer state and the loss stay in float32; only the traffic is compressed.

Each stack does it with its own mechanism (``TorchGroupBackend.apply_compression``, ``HorovodBackend.compressor``):
DDP communication hooks on torch and Accelerate (torch's ``fp16_compress_hook`` and
``bf16_compress_hook``), ``hvd.Compression.fp16`` on Horovod, whose torch build has no bf16
compressor and whose allreduce refuses bfloat16 tensors, so bf16 there is an error naming fp16.

Precision: bf16 keeps 8 significant bits (relative rounding error up to 2^-8 per element),
fp16 11 bits (2^-11) but a range of only ~6e-5..65504 (torch's fp16 hook divides by the world
size *before* the cast, so the sum cannot overflow where the average would not).
"""
from __future__ import annotations

from typing import Any, Optional


def _bf16_compress_hook_gloo(state, bucket):  # unannotated: DDP checks a hook's annotations
    """torch's ``bf16_compress_hook``: gloo reduces bfloat16 on the CPU; DDP's own check of that
    hook (by its name) asks for NCCL 2.10+, which only concerns GPUs."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def register_ddp_hook(model: Any, mode: Optional[str]) -> Any:
    """Register the DDP communication hook for ``mode`` on ``model`` when it is a
    ``DistributedDataParallel`` (anything else, or ``mode`` ``None``: nothing); return ``model``."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if mode is None or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model
    if mode == "fp16":
        hook = default_hooks.fp16_compress_hook
    elif model.device_type == "cpu":
        hook = _bf16_compress_hook_gloo
    else:
        hook = default_hooks.bf16_compress_hook
    model.register_comm_hook(model.process_group, hook)
    return model
