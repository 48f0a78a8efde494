"""The public functions: each delegates to the session (:mod:`unified_dist.session`), its backend
or the collectives, and says in its docstring what it guarantees.

Every function initialises with defaults on first use, so ``ud.init()`` is optional.
"""
from __future__ import annotations

import builtins
import contextlib
from typing import Any, Iterator, List, Optional, Sequence

import torch

from . import session, trackers
from .checkpoint import rng
from .collectives import ops as collectives
from .session import current_backend  # the session's backend, initialising with defaults; not user API


def init(backend: Optional[str] = None, *, mixed_precision: Optional[str] = None,
         gradient_accumulation_steps: Optional[int] = None, timeout: Optional[float] = None,
         debug: Optional[bool] = None, sharding: Optional[str] = None,
         shard_modules: Optional[Sequence[Any]] = None, reshard_after_forward: Optional[bool] = None,
         dp_replicate: Optional[Any] = None, tp: Optional[int] = None, tp_plan: Optional[Any] = None,
         cpu_offload: Optional[bool] = None, activation_checkpointing: Optional[bool] = None,
         pp: Optional[int] = None, pp_schedule: Optional[str] = None, pp_microbatches: Optional[int] = None,
         pp_split: Optional[Sequence[str]] = None, sync_batchnorm: Optional[bool] = None,
         gradient_compression: Optional[str] = None,
         bucket_mb: Optional[float] = None, bucket_view: Optional[bool] = None,
         check_finite: Optional[bool] = None, compile: Optional[Any] = None,  # noqa: A002 - Accelerate's word
         compile_mode: Optional[str] = None, stop_signals: Optional[Any] = None, log_with: Optional[Any] = None,
         project_dir: Optional[str] = None, zero_stage: Optional[int] = None,
         deepspeed_config: Optional[str] = None, offload_optimizer: Optional[str] = None,
         offload_param: Optional[str] = None, gradient_clipping: Optional[float] = None) -> None:
    """Join the job's process group through the detected (or given) backend.

    Every keyword is a setting of :data:`unified_dist.settings.TABLE` (``unified-dist env`` lists
    them with their variables, flags and defaults): ``None`` leaves it to the launcher, then to its
    ``UNIFIED_DIST_*`` variable, then to the default. A keyword that contradicts the launcher (e.g.
    ``mixed_precision="no"`` under ``accelerate launch --mixed_precision bf16``) is a
    :class:`~unified_dist.errors.LaunchError`; a value that does not read (in a keyword or a
    variable) a :class:`~unified_dist.errors.SettingError` naming what is accepted.

    Idempotent: a second call with compatible arguments does nothing; asking for another backend
    or another value of a setting once initialised is an error (call :func:`shutdown` first).
    ``sharding="fsdp"`` makes :func:`prepare` shard models with FSDP2 (:mod:`unified_dist.parallel.sharding`);
    ``sync_batchnorm=True`` synchronises BatchNorm statistics (:mod:`unified_dist.parallel.sync_batchnorm`);
    ``gradient_compression`` sends gradients in 16 bits (:mod:`unified_dist.backends.compression`);
    ``bucket_mb`` sizes the fused gradient reductions (:mod:`unified_dist.backends.buckets`).
    ``dp_replicate=R`` (HSDP: shard inside each of ``R`` replicas, an integer or ``"nodes"``),
    ``tp=T`` with ``tp_plan`` (tensor parallelism), ``cpu_offload`` and ``activation_checkpointing``
    lay the ranks out on a device mesh (:mod:`unified_dist.parallel.mesh`): ``R * dp_shard * T`` ranks, with
    ``dp_shard`` the rest of the world. ``pp=P`` cuts models into ``P`` pipeline stages (``pp_schedule``,
    ``pp_microbatches``, ``pp_split``; train with :func:`pipeline_step`, see ``docs/pipeline.md``).
    ``compile=True`` (or a ``torch.compile`` backend's name) makes
    :func:`prepare` compile each model in place, after wrapping it (see ``docs/hot-path.md``).
    ``stop_signals`` (default SIGUSR1 and SIGTERM) are what :func:`should_stop` listens to
    (``docs/preemption.md``). ``log_with`` (tracker names, ``"all"`` or ``"none"``) and ``project_dir``
    are where :func:`log` and :func:`log_hparams` write (``docs/trackers.md``). ``zero_stage``,
    ``deepspeed_config``, ``offload_optimizer``, ``offload_param`` and ``gradient_clipping`` configure the
    ``deepspeed`` backend (``docs/deepspeed.md``); any other backend refuses them.
    """
    given = dict(mixed_precision=mixed_precision, gradient_accumulation_steps=gradient_accumulation_steps,
                 timeout=timeout, debug=debug, sharding=sharding, shard_modules=shard_modules,
                 reshard_after_forward=reshard_after_forward, sync_batchnorm=sync_batchnorm,
                 gradient_compression=gradient_compression, bucket_mb=bucket_mb, bucket_view=bucket_view,
                 check_finite=check_finite, dp_replicate=dp_replicate, tp=tp, tp_plan=tp_plan, cpu_offload=cpu_offload,
                 activation_checkpointing=activation_checkpointing, pp=pp, pp_schedule=pp_schedule,
                 pp_microbatches=pp_microbatches, pp_split=pp_split, compile=compile, compile_mode=compile_mode,
                 stop_signals=stop_signals, zero_stage=zero_stage, deepspeed_config=deepspeed_config,
                 offload_optimizer=offload_optimizer, offload_param=offload_param, gradient_clipping=gradient_clipping)
    trackers.resolve_choice(log_with, project_dir)  # a tracker name that does not read fails before joining
    session.init(backend, given)
    trackers.choose(log_with, project_dir)


def shutdown() -> None:
    """Close the trackers, then leave the process group; a later call to any function initialises again. A
    background save in flight is written first, and a failed one raises on every rank once the group is left."""
    trackers.forget()
    session.shutdown()


# ---------------------------------------------------------------------- identity
def backend_name() -> str:
    """``"torch"``, ``"accelerate"``, ``"horovod"``, ``"deepspeed"`` or ``"single"``."""
    return current_backend().name


def launcher() -> str:
    """What started this process: ``"python"``, ``"torchrun"``, ``"accelerate"``, ``"horovodrun"``,
    ``"deepspeed"``, ``"srun"``, ``"mpirun"``, ``"ud.launch"``, or ``"existing"`` (a group the code had joined
    itself)."""
    return session.current().detection.launcher


def rank() -> int:
    """Global rank of this process (0 on the main process)."""
    return current_backend().rank


def local_rank() -> int:
    """Rank of this process on its machine."""
    return current_backend().local_rank


def world_size() -> int:
    """Number of processes in the job."""
    return current_backend().world_size


def device() -> torch.device:
    """The device this process should compute on."""
    return current_backend().device


def is_main() -> bool:
    """True on global rank 0 only."""
    return rank() == 0


def is_local_main() -> bool:
    """True on local rank 0 of each machine."""
    return local_rank() == 0


def mixed_precision() -> str:
    """The active mixed-precision mode: ``"no"``, ``"bf16"`` or ``"fp16"``."""
    return current_backend().config.mixed_precision


def device_mesh() -> Any:
    """The torch ``DeviceMesh`` the models are split on, with dimensions ``("dp_replicate",
    "dp_shard", "tp")`` (index it, e.g. ``ud.device_mesh()["tp"]``); ``None`` without sharding or
    tensor parallelism. Global rank ``r`` sits at ``(r // (dp_shard*tp), r // tp % dp_shard, r % tp)``."""
    return current_backend().device_mesh


def data_parallel_rank() -> int:
    """This rank's index among the ranks that see different data, 0 .. ``data_parallel_world_size() - 1``:
    ``rank() // tp``. Tensor-parallel peers share it, and prepared loaders give them the same batches. With
    replica groups: ``g * G + r`` for rank ``r`` of group ``g`` (``G``: a group's data-parallel size)."""
    return current_backend().data_parallel_rank


def data_parallel_world_size() -> int:
    """How many ranks see different data: ``world_size() // tp`` (``world_size()`` without tensor
    parallelism). A prepared loader's global batch is ``batch_size`` times this. With replica groups
    (docs/fault-tolerance.md): the ranks that took part in the latest optimizer step, every group's
    data-parallel ranks while all are up (and before the first step), fewer while a group is away; the
    loader's global batch stays ``batch_size`` times every group's."""
    return current_backend().participating_world_size


def sharding_mode() -> str:
    """``"fsdp"`` when :func:`prepare` shards models (see :func:`init`), else ``"no"``."""
    return current_backend().config.sharding.mode


def pipeline_stages() -> int:
    """The pipeline stages models are cut into (``init(pp=P)``: ``P``), 1 without a pipeline: where it is
    above 1, train with :func:`pipeline_step` and evaluate with :func:`pipeline_forward`."""
    return current_backend().config.sharding.pp


def gradient_compression() -> Optional[str]:
    """The format gradients travel in: ``"bf16"``, ``"fp16"`` or ``None`` (float32)."""
    return current_backend().config.gradient_compression


def gradient_accumulation_steps() -> int:
    """Micro-batches per optimizer step, as given to :func:`init`."""
    return current_backend().config.gradient_accumulation_steps


def zero_stage() -> Optional[int]:
    """The ZeRO stage the ``deepspeed`` backend shards with (0-3: see :func:`init`'s ``zero_stage``, which the
    launcher or a DeepSpeed config may also give), ``None`` on every other backend."""
    return current_backend().zero_stage


# ---------------------------------------------------------------------- preparation
def prepare(*objs: Any) -> Any:
    """Make models, optimizers, LR schedulers and DataLoaders ready; returned in the order given.

    One object in gives that object back (not a 1-tuple). Models are moved to :func:`device`
    and their gradients averaged across ranks (or sharded, with ``init(sharding="fsdp")``;
    BatchNorm synchronised with ``init(sync_batchnorm=True)``); optimizers step only when
    gradients are synchronised (an optimizer built on a model's parameters before this call
    steps the prepared model's); loaders are sharded (see :mod:`unified_dist.data.loaders`) and
    reshuffle each epoch. A loader over an ``IterableDataset`` (a ``datasets`` stream included) is
    sharded the same way, in global batches of the stream (see :mod:`unified_dist.data.streams`;
    :func:`unified_dist.stream` adds a shuffle buffer).
    """
    out = session.current().prepare(objs)
    return out[0] if len(out) == 1 else tuple(out)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The original module inside a prepared model (for saving, ``save_pretrained``, inspection)."""
    return current_backend().unwrap(model)


# ---------------------------------------------------------------------- training
def backward(loss: torch.Tensor) -> None:
    """Backpropagate ``loss``, the mean over this rank's micro-batch, weighted so that the optimizer
    step applies the gradient of the mean loss over all its real samples: ``1/k`` with
    ``gradient_accumulation_steps=k`` and full batches; a ragged last batch or a short last
    accumulation window by what it really holds (scaled for fp16 if needed)."""
    session.current().backward(loss)


def pipeline_step(model: torch.nn.Module, inputs: Any, targets: torch.Tensor, loss_fn: Any) -> torch.Tensor:
    """One pipelined forward and backward (``init(pp=P)``): what ``ud.backward(loss_fn(model(inputs), targets))``
    is without a pipeline; the optimizer steps as usual afterwards.

    ``model`` is the one ``ud.prepare`` returned (a stage of the model); every rank passes its batch
    (``inputs``: a tensor or a tuple of the first stage's positional tensors, or a mapping of tensors given by
    keyword to every stage's forward, such as an attention mask; ``targets``), cut on dimension 0 into
    ``pp_microbatches`` equal microbatches (a batch they do not divide is refused). ``loss_fn(output, target)``
    must average over its microbatch. Returns the mean of the microbatch losses, detached, the same on every
    stage (the last stage computes it and sends it to the others). Gradients are those of the mean loss over
    the batch, averaged over the data-parallel ranks, as one process on the whole global batch would get
    (``docs/pipeline.md``). Refused, in one line, for a model not cut into stages."""
    return session.current().pipeline_step(model, inputs, targets, loss_fn)


def pipeline_forward(model: torch.nn.Module, inputs: Any) -> torch.Tensor:
    """The pipelined forward for evaluation (``init(pp=P)``), what ``model(inputs)`` under ``torch.no_grad()``
    is without a pipeline: no gradients, no optimizer state touched.

    Every rank passes its batch, as to :func:`pipeline_step` (a tensor or a tuple of the first stage's
    positional tensors, or a dict of tensors passed by keyword to every stage's forward). The model's
    output (one tensor) comes back on the last stage's ranks, which alone compute it; the other stages'
    ranks get an empty tensor of its dtype and trailing shape (0 rows), so that
    ``ud.gather_for_metrics(...)`` called on every rank counts each example once (the last stage's rows).
    Refused, in one line, for a model not cut into stages."""
    return session.current().pipeline_forward(model, inputs)


@contextlib.contextmanager
def accumulate(*models: torch.nn.Module) -> Iterator[None]:
    """Wrap one micro-step (forward, backward, step) of ``models``: only every k-th one synchronises.

    With ``gradient_accumulation_steps=k`` the prepared optimizer steps on every k-th
    micro-step and on the last batch of a prepared loader; in between, gradients
    accumulate locally with no communication. Each argument list counts its own micro-steps:
    ``accumulate(D)`` and ``accumulate(G)`` entered once per batch each step their optimizers every
    k batches, and ``accumulate(G, D)`` is one micro-step of both (``docs/several-models.md``).
    """
    with session.current().sync.accumulate(*models):
        yield


def sync_gradients() -> bool:
    """True when the current micro-step synchronises gradients (and the optimizer steps)."""
    return session.current().sync.sync_gradients


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> Optional[torch.Tensor]:
    """Clip the averaged gradients; returns the total norm, or ``None`` on a non-synchronising micro-step.

    Waits for gradient averaging first (Horovod averages asynchronously) and unscales fp16 gradients.
    The norm is of the whole gradient, a plain tensor, also when the parameters are sharded.
    """
    return session.current().clip_grad_norm_(parameters, max_norm, norm_type)


def autocast() -> contextlib.AbstractContextManager:
    """Autocast for the configured mixed precision (a no-op for ``"no"``)."""
    return current_backend().autocast()


def seed_everything(seed: int, per_rank: bool = False) -> int:
    """Seed python, numpy and torch (plus ``per_rank`` adds the data-parallel rank, so tensor-parallel
    peers, which compute on the same batch, draw the same dropout) and the loaders' shuffling.

    The loaders' shuffle seed is always ``seed`` itself, so every rank agrees on the order.
    Call it after :func:`init` (it initialises with defaults otherwise) and before :func:`prepare`.
    Returns the seed used for the RNGs.
    """
    return session.current().seed_everything(seed, per_rank)


# ---------------------------------------------------------------------- collectives
def all_reduce(x: Any, op: str = "mean") -> Any:
    """Reduce ``x`` (a tensor or nested list/tuple/dict of tensors) across ranks with op sum/mean/max/min.

    Returns new tensors; the input is never modified. ``mean`` is sum / world size on every backend.
    Every collective here takes any layout (transposed, sliced, expanded, 0-d, empty) and the same
    dtypes on every backend: bool, (u)int8, int16, uint16, int32, uint32, int64, float16, bfloat16,
    float32, float64, complex64, complex128; any other is a ``CollectiveError``. A result keeps the
    input's dtype, except that a bool sum counts Trues (int64) and an integer or bool mean is float64;
    a bool max is "any", its min "all"; an integer sum past its dtype's range wraps modulo 2**bits;
    complex max/min is refused (no order).
    """
    return collectives.all_reduce(current_backend(), x, op)


def all_gather(x: Any) -> Any:
    """Concatenate ``x`` from every rank along dim 0 in rank order; dim 0 may differ per rank."""
    return collectives.all_gather(current_backend(), x)


def gather_for_metrics(x: Any) -> Any:
    """``all_gather`` inside a prepared loader's loop, minus the rows its last batch padded in.

    Gathering every batch of a prepared evaluation loader yields exactly ``len(dataset)`` rows,
    each sample once, in dataset order (unshuffled loader). Outside such a loop there is no padding
    to drop: it returns exactly what ``all_gather`` returns, and warns once, since there it is
    usually a mistake: an evaluation loader not given to :func:`prepare` runs every rank over the
    whole set, so each example comes back ``world_size`` times; rows kept from a prepared loop and
    gathered after it keep the padded ones.
    """
    return session.current().gather_for_metrics(x)


def all_gather_object(obj: Any) -> List[Any]:
    """Every rank's picklable ``obj`` as a list in rank order."""
    return collectives.all_gather_object(current_backend(), obj)


def rng_states() -> List[Any]:
    """Every rank's RNG states (python, numpy, torch, CUDA), in rank order: put them in a checkpoint."""
    return all_gather_object(rng.capture())


def restore_rng_states(states: List[Any]) -> None:
    """Restore this rank's generators from :func:`rng_states` output.

    Exact when the world size is unchanged; otherwise rank r takes ``states[r % len(states)]``
    (the data order is still exact: it does not depend on these generators).
    """
    if not states:
        return
    rng.restore(states[rank() % len(states)])


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s value on every rank: a tensor (new tensor returned) or any picklable object."""
    return collectives.broadcast(current_backend(), obj, src)


def barrier() -> None:
    """Wait until every rank arrives; a background save (``async_save=True``) in flight is then
    complete, and a failed one raises :class:`~unified_dist.errors.CheckpointError` on every rank."""
    session.current().settle_saves()
    collectives.barrier(current_backend())


def print(*args: Any, **kwargs: Any) -> None:  # noqa: A001 - mirrors builtins.print on purpose
    """``print`` on the main process only."""
    if is_main():
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """The main process runs the block first (e.g. to fill a cache); the others follow."""
    if not is_main():
        barrier()
    try:
        yield
    finally:
        if is_main():
            barrier()


def should_stop() -> bool:
    """Whether the job was asked to stop: ``True`` on **every** rank from the same optimizer step on,
    once any rank received one of ``stop_signals`` (SIGUSR1, SIGTERM by default; docs/preemption.md).

    Costs nothing in a loop that calls :func:`backward`: the signal rides on the exchange each
    optimizer step already makes. In a loop that never calls :func:`backward`, each call is that
    exchange (a collective: call it at the same point on every rank). Calling it once tells the
    facade that the program stops on request; until then a stop signal acts as it would without
    unified_dist. Then save a checkpoint and call :func:`requeue`.
    """
    return session.current().should_stop()


def requeue() -> None:
    """Leave so that the job runs again; call it on every rank after the checkpoint is written, once
    :func:`should_stop` is ``True`` (else a :class:`~unified_dist.errors.UnifiedDistError`: a job that
    failed for another reason must not come back).

    Waits for every rank; under SLURM the main process runs ``scontrol requeue $SLURM_JOB_ID`` (submit
    with ``sbatch --requeue``) and every rank exits with status 0; elsewhere every rank exits with
    status 75 (``EX_TEMPFAIL``), which torchrun's ``--max-restarts``, an elastic agent or a Kubernetes
    ``restartPolicy: OnFailure`` run again. Never returns.
    """
    session.current().requeue()


# ---------------------------------------------------------------------- experiment trackers
def log(values: Any, step: Optional[int] = None) -> None:
    """Write ``values`` (name -> number or string) at ``step`` (``None``: the last step + 1) to the trackers
    of ``init(log_with=...)``, started on first use; the main process writes, every rank may call (no
    communication). With no tracker chosen, a one-line error (``log_with="none"``: nothing is written).
    See :mod:`unified_dist.trackers` and ``docs/trackers.md``."""
    current_backend()  # initialise first: the trackers ask the session which rank writes
    trackers.from_settings()
    trackers.log(values, step)


def log_hparams(config: Any) -> None:
    """Write the hyper-parameters ``config`` (a dict, nested ones flattened to ``"a.b"``, or an
    ``argparse.Namespace``) to the trackers of ``init(log_with=...)``, as :func:`log` does."""
    current_backend()
    trackers.from_settings()
    trackers.log_hparams(config)


def tracker(name: str) -> Any:
    """The running tracker ``name`` (``"tensorboard"``, ...): its ``.tracker`` is the library's own object
    (a ``SummaryWriter``, an ``mlflow.ActiveRun``, a ``wandb.Run``) on the main process, ``None`` elsewhere."""
    current_backend()
    trackers.from_settings()
    return trackers.get(name)
