"""How many gradient bytes go out in one reduction: DDP's bucket size and Horovod's fusion buffer,
one setting (``ud.init(bucket_mb=...)``, ``UNIFIED_DIST_BUCKET_MB``).

Each stack reduces gradients in fused groups while backward still runs: DDP fills buckets of
``bucket_cap_mb`` (torch and Accelerate), Horovod fuses what is ready each cycle into a buffer of
``HOROVOD_FUSION_THRESHOLD`` bytes. Smaller groups start sending earlier and overlap more of
backward; larger ones pay less per-message latency. ``None`` keeps each stack's own default
(DDP 25 MiB with a 1 MiB first bucket, Horovod 128 MiB), which the network benchmark measured
against the alternatives (docs/benchmarks/network.md, "Tuning what the facade controls"). Horovod's
cycle stays its own 1 ms on GPU hosts and becomes :data:`CPU_CYCLE_MS` on CPU hosts, unless set.

DDP (torch and Accelerate) is built with ``gradient_as_bucket_view=True`` by default: each gradient
is a view into its communication bucket instead of a tensor of its own that is copied into the
bucket and back every step. That saves one gradient-sized copy and its memory per rank
(docs/benchmarks/network.md: 0.96x the step time on loopback, faster or level on a 1 Gbit/s link, 3 bucket
storages instead of 105 gradients for the example's model). The one thing a
view forbids is ``grad.detach_()``; the facade's ``zero_grad(set_to_none=False)`` does not call it
on gradients without a graph, as torch's own optimizers do not. Code of one's own that detaches or
replaces ``.grad`` tensors in place can turn the views off with ``UNIFIED_DIST_BUCKET_VIEW=0``.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from ..errors import UnifiedDistError

HOROVOD_VAR = "HOROVOD_FUSION_THRESHOLD"
HOROVOD_CYCLE_VAR = "HOROVOD_CYCLE_TIME"
CPU_CYCLE_MS = 5
"""Horovod's background-thread cycle (ms) when the job computes on CPUs and nobody set one.

Each cycle, Horovod's background thread wakes and coordinates with every other rank. On a GPU
host that thread has idle cores to itself and Horovod's own 1 ms suits it; on a CPU host whose
cores all compute, it takes them from the compute threads. Measured on 2 hosts x 1 core at
1 Gbit/s (docs/benchmarks/network.md, "Horovod's cycle time"): micro-batches that send nothing took
1.33-1.68x as long as on one host at 1 ms, 1.09-1.15x at 5-100 ms (torch: 1.2x). The price of a
longer cycle is latency: a small collective (a logged loss, a metric) waits about one cycle."""
MIB = 1 << 20


def ddp_kwargs(bucket_mb: Optional[float], bucket_view: bool = True) -> Dict[str, Any]:
    """Keyword arguments for ``DistributedDataParallel`` (and Accelerate's DDP kwargs handler):
    ``gradient_as_bucket_view``, and ``bucket_cap_mb`` when a size was asked for."""
    kwargs: Dict[str, Any] = {"gradient_as_bucket_view": bucket_view}
    if bucket_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_mb
    return kwargs


def horovod_env(bucket_mb: Optional[float], env: Mapping[str, str], on_cpu: bool = False) -> Dict[str, str]:
    """Variables to set before ``hvd.init()``: the fusion buffer in bytes, and on CPU hosts a
    :data:`CPU_CYCLE_MS` cycle unless ``HOROVOD_CYCLE_TIME`` (``horovodrun --cycle-time-ms``) is
    already set, which then wins. A different ``HOROVOD_FUSION_THRESHOLD`` (or ``horovodrun
    --fusion-threshold-mb``) already set is an error, so neither setting is silently ignored."""
    out: Dict[str, str] = {}
    if on_cpu and not env.get(HOROVOD_CYCLE_VAR, "").strip():
        out[HOROVOD_CYCLE_VAR] = str(CPU_CYCLE_MS)
    if bucket_mb is None:
        return out
    wanted = str(int(bucket_mb * MIB))
    given = env.get(HOROVOD_VAR)
    if given is not None and given.strip() != wanted:
        raise UnifiedDistError(
            f"bucket_mb={bucket_mb:g} asks for a {wanted}-byte fusion buffer but {HOROVOD_VAR}={given} is set "
            "(horovodrun --fusion-threshold-mb): keep one of the two")
    return {**out, HOROVOD_VAR: wanted}
