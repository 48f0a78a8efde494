"""unified_dist: one facade over torch.distributed, Accelerate and Horovod.

    import unified_dist as ud
    model, optimizer, loader = ud.prepare(model, optimizer, loader)
    for batch in loader:
        with ud.accumulate(model), ud.autocast():
            loss = model(**batch).loss
            ud.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

The same script runs under python, torchrun, accelerate launch, horovodrun, srun and mpirun,
in a process that already joined a group, or started from Python with ``ud.launch(fn)``.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict

__version__ = "0.1.0"

_FROM: Dict[str, str] = {
    **dict.fromkeys(["CollectiveMismatch"], ".collectives.checkmode"),
    **dict.fromkeys(["ElasticState", "elastic_run"], ".elastic"),
    **dict.fromkeys(["launch"], ".spawn"),
    **dict.fromkeys(["RNG"], ".checkpoint.rng"),
    **dict.fromkeys(["stream"], ".data.streams"),
    **dict.fromkeys(["BackendNotInstalled", "CheckpointError", "CollectiveError", "CollectiveTimeout", "LaunchError",
                     "NonFiniteLoss", "PeerLost", "PipelineError", "PrecisionError", "UnifiedDistError",
                     "WorkerFailed"], ".errors"),
    **dict.fromkeys(["accumulate", "all_gather", "all_gather_object", "all_reduce", "autocast", "backend_name",
                     "backward", "barrier", "broadcast", "clip_grad_norm_", "data_parallel_rank",
                     "data_parallel_world_size", "device", "device_mesh", "gather_for_metrics",
                     "gradient_accumulation_steps", "gradient_compression", "init", "is_local_main", "is_main",
                     "launcher", "local_rank", "log", "log_hparams", "main_process_first", "mixed_precision",
                     "pipeline_forward", "pipeline_stages", "pipeline_step", "prepare", "print", "rank",
                     "requeue", "restore_rng_states", "rng_states", "seed_everything", "sharding_mode",
                     "should_stop", "shutdown", "sync_gradients", "tracker", "unwrap", "world_size",
                     "zero_stage"], ".facade"),
    **dict.fromkeys(["get_state_dict", "latest_checkpoint", "load", "load_sharded", "reserve_async_save", "save",
                     "save_checkpoint", "save_sharded"], ".saving"),
}
"""Where each public name lives. They are imported on first use (PEP 562), so ``import unified_dist``
and the ``unified-dist`` command start without importing torch until something needs it."""

__all__ = list(_FROM)


def __getattr__(name: str) -> Any:
    module = _FROM.get(name)
    if module is None:
        raise AttributeError(f"module 'unified_dist' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from .checkpoint.rng import RNG  # noqa: F401
    from .collectives.checkmode import CollectiveMismatch  # noqa: F401
    from .data.streams import stream  # noqa: F401
    from .elastic import ElasticState, elastic_run  # noqa: F401
    from .errors import (  # noqa: F401
        BackendNotInstalled,
        CheckpointError,
        CollectiveError,
        CollectiveTimeout,
        LaunchError,
        NonFiniteLoss,
        PeerLost,
        PipelineError,
        PrecisionError,
        UnifiedDistError,
        WorkerFailed,
    )
    from .facade import (  # noqa: F401
        accumulate,
        all_gather,
        all_gather_object,
        all_reduce,
        autocast,
        backend_name,
        backward,
        barrier,
        broadcast,
        clip_grad_norm_,
        data_parallel_rank,
        data_parallel_world_size,
        device,
        device_mesh,
        gather_for_metrics,
        gradient_accumulation_steps,
        gradient_compression,
        init,
        is_local_main,
        is_main,
        launcher,
        local_rank,
        log,
        log_hparams,
        main_process_first,
        mixed_precision,
        pipeline_forward,
        pipeline_stages,
        pipeline_step,
        prepare,
        print,
        rank,
        requeue,
        restore_rng_states,
        rng_states,
        seed_everything,
        sharding_mode,
        should_stop,
        shutdown,
        sync_gradients,
        tracker,
        unwrap,
        world_size,
        zero_stage,
    )
    from .saving import (  # noqa: F401
        get_state_dict,
        latest_checkpoint,
        load,
        load_sharded,
        reserve_async_save,
        save,
        save_checkpoint,
        save_sharded,
    )
    from .spawn import launch  # noqa: F401
