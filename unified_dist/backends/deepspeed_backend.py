"""DeepSpeed's engine (ZeRO stages 0-3), as started by ``deepspeed``, ``accelerate launch --use_deepspeed``,
torchrun, srun or mpirun (``init(backend="deepspeed")``).

Why an engine and not a wrapper: DeepSpeed builds the model and the optimizer into one object
(``deepspeed.initialize``), partitions optimizer state (stage 1), gradients (2) and parameters (3), and
owns the backward (its loss scaling, its reduce-scatter hooks) and the step (step and zero_grad in one).
So ``ud.prepare`` hands the model and its optimizer to ``deepspeed.initialize`` together, and the facade's
loop keeps its meaning by telling the engine, not by undoing it:

- the micro-step that synchronises is the engine's accumulation boundary
  (``set_gradient_accumulation_boundary``), so the engine's ``gradient_accumulation_steps`` and the facade's
  ``ud.accumulate`` agree, the short last window of an epoch included;
- ``ud.backward`` gives the engine the loss already weighted by the facade (``scale_wrt_gas=False``: the
  engine divides by nothing more);
- the prepared optimizer's ``step`` is the engine's ``step``, called once per optimizer step;
- the configuration is built once from the settings table (ZeRO stage, accumulation, mixed precision, offload,
  gradient clipping), on top of the user's DeepSpeed config file where one is given, and DeepSpeed's own default
  gradient clipping (1.0) is turned off unless the settings or the file ask for it (``accelerate launch
  --gradient_clipping`` does): otherwise the facade clips only when ``ud.clip_grad_norm_`` asks, on every backend
  alike.

DeepSpeed runs on torch's default process group (joined as the torch backend joins it: gloo on a CPU, nccl on
GPUs), so the collectives are the torch backend's.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from ..detection import Detection
from ..errors import BackendNotInstalled, SettingError, UnifiedDistError
from .base import Config, weighted
from .optimizer_view import OptimizerView
from .process_group import withdraw_rendezvous
from .torch_ddp import TorchBackend

ACCELERATE_DEFAULT_STAGE = 2
"""The ZeRO stage ``accelerate launch --use_deepspeed`` means without ``--zero_stage`` (Accelerate's
``DeepSpeedPlugin`` default)."""


def refusal(config: Config) -> Optional[str]:
    """Why the deepspeed backend cannot run ``config``, in one line naming what to use instead (``None``: it can)."""
    sharding = config.sharding
    if sharding.splits_model:
        what = ("sharding='fsdp'" if sharding.enabled else f"tp={sharding.tp}" if sharding.tp > 1
                else f"pp={sharding.pp}" if sharding.pp > 1 else f"dp_replicate={sharding.dp_replicate}")
        return (f"{what} is torch's FSDP2/TP/pipeline layout; the deepspeed backend shards with ZeRO: use "
                "zero_stage=1, 2 or 3, or backend='torch' for that layout")
    if config.gradient_compression:
        return (f"gradient_compression={config.gradient_compression!r} is DDP's and Horovod's; DeepSpeed reduces in "
                "its own format: drop it, or use backend='torch' or 'horovod'")
    if config.bucket_mb is not None:
        return ("bucket_mb sizes DDP's and Horovod's buckets; set DeepSpeed's reduce_bucket_size in a DeepSpeed config "
                "file (deepspeed_config=...)")
    if config.compile:
        return (f"compile={config.compile!r}: the deepspeed backend does not compile yet; leave compile off, or use "
                "backend='torch'")
    return None


def accelerate_words(environ: Mapping[str, str], stage: int) -> Tuple[Optional[str], List[str]]:
    """What ``accelerate launch --use_deepspeed``'s words that are not settings mean for a facade script: a one-line
    refusal (or ``None``) and one-line warnings. ``--deepspeed_moe_layer_cls_names`` (ZeRO-3 leaf modules) is refused
    at ZeRO-3 (the only stage that reads it): this backend does not mark them; ``--zero3_init_flag true`` (build the
    model partitioned, inside ``deepspeed.zero.Init``) and ``--zero3_save_16bit_model true`` (save 16-bit weights)
    are said once each: the facade's script builds its model whole before ``ud.prepare`` partitions it, and
    ``ud.save`` writes the float32 weights gathered from the partitions. Pure."""
    moe = environ.get("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES", "").strip()
    problem = (f"accelerate launch --deepspeed_moe_layer_cls_names {moe}: the deepspeed backend does not mark MoE "
               "layers as ZeRO-3 leaf modules; call deepspeed.utils.set_z3_leaf_modules(model, [those classes]) "
               "before ud.prepare, and drop the flag") if moe and moe.lower() != "none" and stage == 3 else None
    said = {name: environ.get(f"ACCELERATE_DEEPSPEED_{name}", "").strip().lower() in ("true", "1", "yes")
            for name in ("ZERO3_INIT", "ZERO3_SAVE_16BIT_MODEL")}
    notes = []
    if said["ZERO3_INIT"] and stage == 3:
        notes.append("accelerate launch --zero3_init_flag true: a facade script builds its model whole, and "
                     "ud.prepare partitions it; build it inside deepspeed.zero.Init() yourself where one process "
                     "cannot hold it")
    if said["ZERO3_SAVE_16BIT_MODEL"] and stage == 3:
        notes.append("accelerate launch --zero3_save_16bit_model true: ud.save writes the float32 weights gathered "
                     "from ZeRO-3's partitions (the portable format), not 16-bit ones")
    return problem, notes


OFFLOADS = ("offload_optimizer", "offload_param")
"""What ZeRO can offload, as both the settings and a DeepSpeed config file's ``zero_optimization`` name it."""


def offload_devices(file: Dict[str, Any], config: Config) -> Dict[str, str]:
    """Where the job offloads each of :data:`OFFLOADS` (only those it offloads): the setting's device where it is
    given, else the DeepSpeed config ``file``'s (a dict) where it says one (``"none"``, ``"auto"`` or nothing: no
    offload). Pure; whether the two agree is :func:`engine_config`'s to check."""
    zero = file.get("zero_optimization") or {}
    devices = {}
    for key in OFFLOADS:
        entry = zero.get(key)
        said = entry.get("device") if isinstance(entry, dict) else None
        device = getattr(config, key) or (said if _said(said) and said != "none" else None)
        if device:
            devices[key] = device
    return devices


def offload_problem(devices: Dict[str, str], stage: int) -> Optional[str]:
    """Why ZeRO ``stage`` cannot offload ``devices`` (:func:`offload_devices`), in one line, or ``None``: parameters
    only at ZeRO-3, optimizer partitions at ZeRO 1-3 (elsewhere DeepSpeed would run without the offload, without a
    word). Pure."""
    if "offload_param" in devices and stage != 3:
        return (f"offload_param={devices['offload_param']!r} offloads ZeRO-3's parameter partitions, and ZeRO stage "
                f"{stage} keeps whole parameters on every rank: use zero_stage=3, or drop it")
    if "offload_optimizer" in devices and stage == 0:
        return (f"offload_optimizer={devices['offload_optimizer']!r} offloads ZeRO's optimizer partitions, and stage "
                "0 has none: use zero_stage=1, 2 or 3, or drop it")
    return None


def zero_stage_of(config: Config, file: Dict[str, Any], launcher: str) -> int:
    """The ZeRO stage a job runs at: ``zero_stage=`` (settings table), else the DeepSpeed config ``file``'s (a
    dict), else Accelerate's default under ``accelerate launch``, else 0. Pure."""
    if config.zero_stage is not None:
        return int(config.zero_stage)
    said = file.get("zero_optimization", {}).get("stage")
    return int(said) if _said(said) else (ACCELERATE_DEFAULT_STAGE if launcher == "accelerate" else 0)


def read_config_file(path: Optional[str]) -> Dict[str, Any]:
    """The DeepSpeed config file at ``path`` as a dict (``{}`` without one); a one-line error if it does not read."""
    if not path:
        return {}
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise SettingError(f"deepspeed_config={path!r} does not read as a DeepSpeed JSON config ({exc})") from None
    if not isinstance(value, dict):
        raise SettingError(f"deepspeed_config={path!r} holds a {type(value).__name__}, not a JSON object")
    return value


def _said(value: Any) -> bool:
    """Whether a config file's value says something (transformers' ``"auto"`` leaves it to the settings)."""
    return value is not None and value != "auto"


def engine_config(file: Dict[str, Any], path: Optional[str], stage: int, accumulation: int, mixed_precision: str,
                  micro_batch: int, offload_optimizer: Optional[str] = None, offload_param: Optional[str] = None,
                  gradient_clipping: Optional[float] = None) -> Dict[str, Any]:
    """The config ``deepspeed.initialize`` gets: the file's, with the settings' values filled in where it leaves them
    out (or says ``"auto"``). Where it says another value than the settings, a one-line :class:`SettingError`.

    Offload (the settings' or the file's): the optimizer's at ZeRO 1-3, the parameters' at ZeRO-3 only, else a
    one-line :class:`SettingError` (DeepSpeed would leave it out without a word). With the optimizer offloaded the
    user's own torch optimizer steps DeepSpeed's partitions in CPU memory (``zero_force_ds_cpu_optimizer`` off,
    unless the file says otherwise). Pure."""
    config = copy.deepcopy(file)

    def agree(keys: List[str], value: Any, setting: str) -> None:
        holder = config
        for key in keys[:-1]:
            if not isinstance(holder.get(key), dict):  # absent, or null in the file
                holder[key] = {}
            holder = holder[key]
        said = holder.get(keys[-1])
        if _said(said) and said != value:
            raise SettingError(f"the DeepSpeed config {path} says {'.'.join(keys)}={said!r} but {setting} says "
                               f"{value!r}; make them agree (the settings are read once, from one place)")
        holder[keys[-1]] = value

    agree(["zero_optimization", "stage"], stage, "zero_stage")
    agree(["gradient_accumulation_steps"], accumulation, "gradient_accumulation_steps")
    agree(["train_micro_batch_size_per_gpu"], micro_batch, "the prepared DataLoader's batch_size")
    agree(["bf16", "enabled"], mixed_precision == "bf16", f"mixed_precision={mixed_precision!r}")
    agree(["fp16", "enabled"], mixed_precision == "fp16", f"mixed_precision={mixed_precision!r}")
    for key, device in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if device is not None:
            agree(["zero_optimization", key, "device"], device, key)
    if gradient_clipping is not None:
        agree(["gradient_clipping"], float(gradient_clipping), "gradient_clipping")
    offloaded = offload_devices(config, Config())  # what the filled-in config offloads
    problem = offload_problem(offloaded, stage)
    if problem:
        raise SettingError(problem)
    if "offload_optimizer" in offloaded:
        config.setdefault("zero_force_ds_cpu_optimizer", False)  # the user's torch optimizer steps on the CPU
    if not _said(config.get("train_batch_size")):
        config.pop("train_batch_size", None)  # DeepSpeed derives it: micro batch x accumulation x world size
    if not _said(config.get("gradient_clipping")):
        config["gradient_clipping"] = 0.0  # DeepSpeed's default is 1.0: no backend clips unless asked
    config.setdefault("zero_allow_untested_optimizer", True)  # the user's own torch optimizer
    config.setdefault("steps_per_print", 2**62)  # the facade's loop reports; DeepSpeed's progress lines stay off
    return config


SHARED_MEMORY = Path("/dev/shm")


def shared_buffer(addr: str, port: str, rank: str) -> str:
    """The name of the shared-memory buffer DeepSpeed's CPU all-reduce (``shm.cpp`` at 0.19.8) makes for ``rank`` of
    the job at ``addr``:``port`` (``MASTER_ADDR``, ``MASTER_PORT``), this user's; ``"*"`` for any (a glob pattern
    in :data:`SHARED_MEMORY`)."""
    return f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


class DeepSpeedBackend(TorchBackend):
    """One DeepSpeed engine per session, built by ``ud.prepare`` from the model and optimizer given together."""

    name = "deepspeed"
    reads_deepspeed_settings = True

    def __init__(self, detection: Detection, config: Config) -> None:
        problem = refusal(config)
        if problem:
            raise UnifiedDistError(problem)
        try:
            import deepspeed
        except ImportError as exc:
            raise BackendNotInstalled(
                f"backend 'deepspeed' needs the deepspeed package ({exc}); install it with `make setup` "
                "(DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8, after torch)") from None
        self._file = read_config_file(config.deepspeed_config)
        self.zero_stage = zero_stage_of(config, self._file, detection.launcher)
        problem = offload_problem(offload_devices(self._file, config), self.zero_stage)
        if problem:  # at ud.init, before the model and data are built (engine_config checks it again, whole)
            raise SettingError(problem)
        if detection.launcher == "accelerate":
            problem, notes = accelerate_words(os.environ, self.zero_stage)
            if problem:
                raise UnifiedDistError(problem)
            for note in notes:
                warnings.warn(f"unified_dist: {note}", UserWarning, stacklevel=4)
        super().__init__(detection, config)  # joins the default group: gloo on a CPU, nccl on GPUs
        deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)
        self._unlink_shared_buffer()
        self.engine: Any = None
        self._pending: Dict[str, Any] = {}

    def _unlink_shared_buffer(self) -> None:
        """DeepSpeed's all-reduce on a CPU (its ``shm_comm`` op, when every rank is on this host: ``LOCAL_SIZE``
        equals the world) maps one shared-memory buffer per rank, ``/dev/shm/deepspeed_allreduce_buffer_`` + uid,
        ``MASTER_ADDR``, ``MASTER_PORT`` and rank (69 MB each at 0.19.8), and never unlinks it: every run left its
        ranks' buffers in memory until the machine restarted. Each rank maps every other's before
        ``init_distributed`` returns, so once all have returned (a barrier) each unlinks its own name; the mappings
        live on until the processes end, and no buffer outlives them, even a killed one's."""
        if os.environ.get("LOCAL_SIZE") != str(self.world_size) or self.world_size < 2:
            return  # DeepSpeed made none (its own condition), the same verdict on every rank
        path = SHARED_MEMORY / shared_buffer(os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""),
                                             str(self.rank))
        dist.barrier()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    # ----------------------------------------------------------------- preparation
    def about_to_prepare(self, objs: tuple) -> None:
        """Remember the optimizer and the loader's batch size that come with the model (one
        ``deepspeed.initialize``)."""
        models = [o for o in objs if isinstance(o, torch.nn.Module) and any(p.requires_grad for p in o.parameters())]
        optimizers = [o for o in objs if isinstance(o, torch.optim.Optimizer)]
        if not models and not optimizers:
            return
        if self.engine is not None or len(models) != 1 or len(optimizers) != 1:
            raise UnifiedDistError(
                "the deepspeed backend builds one engine from one trainable model and its optimizer: pass exactly "
                "those two (and the loaders) to one ud.prepare call, once per session; for several models use "
                "backend='torch'")
        loaders = [o for o in objs if isinstance(o, torch.utils.data.DataLoader) and o.batch_size]
        self._pending = {"model": models[0], "optimizer": optimizers[0],
                         "micro_batch": loaders[0].batch_size if loaders else 1,
                         # the parameters of the user's groups, before DeepSpeed points the groups at its partitions
                         "groups": [list(group["params"]) for group in optimizers[0].param_groups]}

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            return model.to(self.device)
        if self._pending.get("model") is not model:
            raise UnifiedDistError("the deepspeed backend prepares a model together with its optimizer: "
                                   "ud.prepare(model, optimizer, loader)")
        import deepspeed

        optimizer = self._pending["optimizer"]
        config = engine_config(self._file, self.config.deepspeed_config, self.zero_stage,
                               self.config.gradient_accumulation_steps, self.config.mixed_precision,
                               self._pending["micro_batch"], self.config.offload_optimizer, self.config.offload_param,
                               self.config.gradient_clipping)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                    dist_init_required=False)
        return self.engine

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        if self.engine is None or self._pending.get("optimizer") is not optimizer:
            raise UnifiedDistError("the deepspeed backend prepares an optimizer together with its model: "
                                   "ud.prepare(model, optimizer, loader)")
        return EngineOptimizer(self.engine, optimizer, self._pending["groups"])

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from deepspeed import DeepSpeedEngine

        return super().unwrap(model.module if isinstance(model, DeepSpeedEngine) else model)

    # ----------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, scaler: Optional[Any] = None, weight: Fraction = Fraction(1)) -> None:
        if self.engine is None:
            raise UnifiedDistError("ud.backward under the deepspeed backend needs the model and optimizer prepared "
                                   "first: ud.prepare(model, optimizer, loader)")
        self.engine.backward(weighted(loss, weight), scale_wrt_gas=False)  # the facade weighted it already

    def set_sync_gradients(self, sync: bool) -> None:
        if self.engine is not None:
            self.engine.set_gradient_accumulation_boundary(sync)

    def make_grad_scaler(self) -> Optional[Any]:
        return None  # fp16: DeepSpeed's engine scales the loss itself

    def clip_gradients(self, parameters: List[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        """Where the engine steps the user's optimizer on the module's gradients (stage 0, no bf16): torch's clip,
        as the torch backend. Under ZeRO the averaged gradients live in DeepSpeed's partitions: the norm is that of
        the full gradients DeepSpeed gathers (``safe_get_full_grad``), and the engine's optimizer clips to
        ``max_norm`` inside this step (its ``clip_grad``, the same ``max_norm / (norm + 1e-6)`` rule as torch's),
        which covers all of the engine's parameters: a subset, or a norm other than 2, is refused in one line."""
        engine = self.engine
        if engine is None or engine.optimizer is self._pending.get("optimizer"):
            return super().clip_gradients(parameters, max_norm, norm_type)
        wanted = {id(p) for p in parameters}
        if wanted != {id(p) for p in engine.module.parameters() if p.requires_grad} or float(norm_type) != 2.0 \
                or not hasattr(engine.optimizer, "clip_grad"):
            raise UnifiedDistError(
                f"ud.clip_grad_norm_ under ZeRO stage {self.zero_stage} clips all of the model's parameters by their "
                "2-norm (DeepSpeed clips inside its step): pass model.parameters() and norm_type=2")
        from deepspeed.utils import safe_get_full_grad

        grads = [safe_get_full_grad(p) for p in engine.module.parameters() if p.requires_grad]  # a collective
        norms = [torch.linalg.vector_norm(g.float()) for g in grads if g is not None]
        norm = torch.linalg.vector_norm(torch.stack(norms))
        engine.optimizer.clip_grad = float(max_norm)  # this step only: EngineOptimizer.step puts the config's back
        return norm

    def checkpoint_problem(self, action: str) -> Optional[str]:
        """``ud.save``/``ud.load`` take the portable format under every stage (:mod:`.deepspeed_checkpoint`).
        Per-rank shards (``save_sharded``/``load_sharded``, torch's DCP over the module) would miss DeepSpeed's
        partitions: refused where they hold them (ZeRO-3's parameters on save, the master weights on load)."""
        if action == "save_sharded" and self.zero_stage == 3 or action == "load_sharded" and self.zero_stage > 0:
            return (f"ud.{action} under ZeRO stage {self.zero_stage} would miss DeepSpeed's partitions: use "
                    f"ud.{action.split('_')[0]}(...) (the portable format, gathered), or zero_stage 0")
        return None

    @property
    def saves_collectively(self) -> bool:
        """Under ZeRO the weights and optimizer state are gathered from every rank's partitions."""
        return self.zero_stage > 0

    def _zero_engine_of(self, model: torch.nn.Module) -> Any:
        """The engine whose ZeRO partitions hold ``model``'s weights, or ``None`` (stage 0, or another module)."""
        engine = self.engine
        if engine is None or not self.zero_stage or self.unwrap(model) is not engine.module:
            return None
        return engine

    def model_state_dict(self, model: torch.nn.Module) -> dict:
        """Under ZeRO the full state dict with the float32 master weights (a collective); else the module's."""
        engine = self._zero_engine_of(model)
        if engine is None:
            return super().model_state_dict(model)
        from .deepspeed_checkpoint import model_state

        return model_state(engine)

    def load_model_state_dict(self, model: torch.nn.Module, state: dict, strict: bool) -> None:
        """Under ZeRO into the module and DeepSpeed's float32 master weights (a collective); else the module's."""
        engine = self._zero_engine_of(model)
        if engine is None:
            super().load_model_state_dict(model, state, strict)
            return
        from .deepspeed_checkpoint import load_model_state

        load_model_state(engine, state, strict)

    def shutdown(self) -> None:
        """Leave the group through DeepSpeed, which then forgets the groups it derived from it (a later
        ``ud.init`` builds its engine on the new group)."""
        engine, self.engine = self.engine, None
        if not dist.is_initialized():
            return
        dist.barrier()  # nobody is still reducing when the engine goes
        if engine is not None and hasattr(engine, "destroy"):
            engine.destroy()
        if self._owns_group:
            from deepspeed import comm

            comm.destroy_process_group()
        withdraw_rendezvous(self._exported)


class EngineOptimizer(OptimizerView):
    """The user's optimizer as DeepSpeed's engine steps it: ``step()`` is the engine's step (which also zeroes
    the gradients); ``param_groups`` and ``state`` are the user's optimizer's (:class:`OptimizerView`; under ZeRO
    its parameters are DeepSpeed's flat partitions), so a learning-rate scheduler drives what the engine steps.
    ``add_param_group`` is refused: the engine partitioned the groups it was given and would never step a new one.
    ``groups``: the parameters of the optimizer's groups as the user built them (the portable state's layout)."""

    def __init__(self, engine: Any, optimizer: torch.optim.Optimizer,
                 groups: Optional[List[List[torch.nn.Parameter]]] = None) -> None:
        super().__init__(optimizer)
        self.engine = engine
        self.groups = groups if groups is not None else [list(group["params"]) for group in optimizer.param_groups]

    def add_param_group(self, param_group: dict) -> None:
        raise UnifiedDistError("optimizer.add_param_group under the deepspeed backend: DeepSpeed's engine was built "
                               "with the optimizer's groups and would never step a new one; give the optimizer every "
                               "group before ud.prepare")

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One engine step (the optimizer's update, then zeroed gradients); a closure is refused."""
        if closure is not None:
            raise UnifiedDistError("optimizer.step(closure) under the deepspeed backend: DeepSpeed's engine steps "
                                   "without a closure; call step() after ud.backward(loss)")
        clip = self.engine.gradient_clipping()
        try:
            self.engine.step()
        finally:  # a clip ud.clip_grad_norm_ asked for holds for this step only
            if hasattr(self.engine.optimizer, "clip_grad"):
                self.engine.optimizer.clip_grad = clip

    def zero_grad(self, set_to_none: bool = True) -> None:
        if hasattr(self.engine.optimizer, "zero_grad") and self.engine.zero_optimization():
            self.engine.optimizer.zero_grad(set_to_none=True)
        else:
            self.engine.zero_grad()

    def state_dict(self) -> dict:
        """torch's ``state_dict()`` of the user's optimizer over the parameters it was built with: under stage 0 its
        own; under ZeRO gathered from DeepSpeed's partitions (a collective: every rank calls it)."""
        if not self.engine.zero_optimization():
            return self.optimizer.state_dict()
        from .deepspeed_checkpoint import optimizer_state

        return optimizer_state(self.engine, self.optimizer, self.groups)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's ``state_dict()`` layout (from any backend); under ZeRO into DeepSpeed's partitions (a
        collective: every rank calls it with the same state)."""
        if not self.engine.zero_optimization():
            self.optimizer.load_state_dict(state_dict)
            return
        from .deepspeed_checkpoint import load_optimizer_state

        load_optimizer_state(self.engine, self.optimizer, self.groups, state_dict)
