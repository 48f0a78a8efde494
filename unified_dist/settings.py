"""Every setting, declared once: :data:`TABLE`.

A :class:`Setting` says everything about one knob: its ``ud.init`` keyword (also the
:class:`~unified_dist.backends.Config` field), its ``UNIFIED_DIST_*`` environment variable, its
``unified-dist launch`` flag, what a launcher may say about it (e.g. ``accelerate launch
--mixed_precision``), how its text reads (:class:`Switch`, :class:`Choice`, :class:`Number`,
:class:`Text`), its default and one line of help. ``ud.init`` (:func:`resolve_all`),
``unified-dist launch`` (its flags and the variables it hands the script) and ``unified-dist env``
(:func:`in_effect`) are derived from the table; ``tests/unit/test_settings.py`` checks that ``init``'s
signature and ``Config``'s fields name exactly the table's keywords.

One rule resolves every setting (:func:`resolve`): the code (an ``init`` keyword) > what the
launcher said > the environment variable > the default. When the code and the launcher say
different things, that is a :class:`~unified_dist.errors.LaunchError` (drop one of them); a launcher
"says" something only with a value other than its own default (``accelerate launch`` always exports
``ACCELERATE_MIXED_PRECISION``, ``no`` unless asked). A value that does not read cleanly, in a
keyword or a variable (``UNIFIED_DIST_SYNC_BATCHNORM=maybe``), is a one-line
:class:`~unified_dist.errors.SettingError` naming what is accepted.

Any other ``UNIFIED_DIST_*`` name is a misspelling: :func:`unknown_variables` finds it with the
closest known name, ``ud.init`` warns about it (:func:`warn_unknown`) and ``unified-dist env`` lists
it among its problems. ``tests/unit/test_settings.py`` fails when a ``UNIFIED_DIST_*`` name appears in
the repository and not here.

Importing this module is free: it imports nothing but the standard library (and
:mod:`unified_dist.errors`, :mod:`unified_dist.registry`, which do the same).
"""
from __future__ import annotations

import difflib
import json
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple, Type, Union

from .errors import LaunchError, PrecisionError, SettingError
from .registry import NAMES as BACKEND_NAMES

PREFIX = "UNIFIED_DIST_"
TRACKER_NAMES = ("jsonl", "tensorboard", "mlflow", "wandb", "trackio")
"""The experiment trackers :mod:`unified_dist.trackers` writes to (``log_with``), in the order ``all`` starts them."""
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


# ---------------------------------------------------------------------- how values read
class Switch:
    """On or off: 1/true/yes/on or 0/false/no/off in any case; in code, ``True`` or ``False``."""

    accepted = "1, true, yes, on or 0, false, no, off (any case)"

    def read(self, text: str) -> bool:
        word = text.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
        raise ValueError(f"is neither on nor off; use {self.accepted}")

    def take(self, value: Any) -> bool:
        if isinstance(value, bool) or value in (0, 1):
            return bool(value)
        raise ValueError("takes True or False")

    def show(self, value: Any) -> str:
        return "on" if value else "off"

    def flag_value(self, value: Any) -> str:
        return "1" if value else "0"


@dataclass(frozen=True)
class Choice:
    """One of ``values`` (any case); the words in ``nothing`` read as ``None`` (e.g. ``"none"``)."""

    values: Tuple[str, ...]
    what: str
    nothing: Tuple[str, ...] = ()

    @property
    def accepted(self) -> str:
        return " | ".join(self.values + self.nothing[:1])

    def read(self, text: str) -> Optional[str]:
        word = text.strip().lower()
        if word in self.values:
            return word
        if word in self.nothing:
            return None
        raise ValueError(f"unknown {self.what} {text!r}; use one of {', '.join(self.values + self.nothing[:1])}")

    def take(self, value: Any) -> Optional[str]:
        if not isinstance(value, str):
            raise ValueError(f"unknown {self.what} {value!r}; use one of {', '.join(self.values)}")
        return self.read(value)

    def show(self, value: Any) -> str:
        return self.nothing[0] if value is None and self.nothing else str(value)

    flag_value = show


@dataclass(frozen=True)
class Number:
    """A number of ``unit``: above 0 (``integer``: a whole number >= 1)."""

    unit: str
    what: str
    integer: bool = False

    @property
    def accepted(self) -> str:
        return f"an integer >= 1 ({self.unit})" if self.integer else f"{self.unit} (> 0)"

    def read(self, text: str) -> Union[int, float]:
        try:
            return self.take(int(text) if self.integer else float(text))
        except (TypeError, ValueError):
            raise ValueError(self._wrong(text)) from None

    def take(self, value: Any) -> Union[int, float]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (self.integer and value != int(value)):
            raise ValueError(self._wrong(value))
        if not (value >= 1 if self.integer else value > 0):
            raise ValueError(self._wrong(value))
        return int(value) if self.integer else float(value)

    def _wrong(self, value: Any) -> str:
        return (f"{self.what} must be {'an integer >= 1' if self.integer else 'a positive number of ' + self.unit}, "
                f"got {value!r}")

    def show(self, value: Any) -> str:
        return "" if value is None else f"{value:g}"

    flag_value = show


@dataclass(frozen=True)
class Compiler:
    """Whether and with which dynamo backend ``ud.prepare`` compiles models: off (0/false/no/off,
    ``False``), on (1/true/yes/on, ``True``: ``inductor``) or a backend's name (``aot_eager``,
    ``eager``, ...; ``torch._dynamo.list_backends()`` names the installed ones, checked at ``init``)."""

    accepted: str = "on (inductor), off, or a torch.compile backend's name (inductor, aot_eager, eager, ...)"

    def read(self, text: str) -> Optional[str]:
        word = text.strip().lower()
        if word in TRUE_WORDS:
            return "inductor"
        if word in FALSE_WORDS:
            return None
        if not word.replace("_", "").isalnum():
            raise ValueError(f"is not a torch.compile backend; use {self.accepted}")
        return word

    def take(self, value: Any) -> Optional[str]:
        if isinstance(value, bool):
            return "inductor" if value else None
        if isinstance(value, str):
            return self.read(value)
        raise ValueError("takes True, False or a torch.compile backend's name")

    def show(self, value: Any) -> str:
        return "off" if value is None else str(value)

    def flag_value(self, value: Any) -> str:
        return "0" if value is None else str(value)


@dataclass(frozen=True)
class Signals:
    """Signal names, separated by commas or spaces, with or without ``SIG`` (``USR1,TERM``); ``none``
    (or an empty list in code) for none."""

    accepted: str = "signal names such as USR1,TERM (commas or spaces; SIG optional), or none"

    def read(self, text: str) -> Tuple[str, ...]:
        words = text.replace(",", " ").split()
        if [w.lower() for w in words] in (["none"], ["no"], ["off"]):
            return ()
        return self.take(tuple(words))

    def take(self, value: Any) -> Tuple[str, ...]:
        import signal

        if isinstance(value, str):
            return self.read(value)
        if not isinstance(value, (list, tuple)):
            value = [value]
        names = []
        for item in value:
            name = item.name if isinstance(item, signal.Signals) else str(item).strip().upper()
            if not name.startswith("SIG"):
                name = "SIG" + name
            if name in ("SIGKILL", "SIGSTOP") or not isinstance(getattr(signal, name, None), signal.Signals):
                raise ValueError(f"{item!r} is not a signal a process can catch; use {self.accepted}")
            if name not in names:
                names.append(name)
        return tuple(names)

    def show(self, value: Any) -> str:
        return ",".join(n[3:] for n in value) if value else "none"

    flag_value = show


@dataclass(frozen=True)
class Text:
    """Free text (a path, a name): read as given."""

    accepted: str

    def read(self, text: str) -> str:
        return text

    take = read

    def show(self, value: Any) -> str:
        return "" if value is None else str(value)

    flag_value = show


@dataclass(frozen=True)
class Replicas:
    """How many data-parallel replicas (HSDP's replicate dimension): a whole number >= 1, or
    ``"nodes"`` (one replica per machine, each machine's ranks sharding among themselves)."""

    accepted: str = "an integer >= 1, or nodes (one replica per machine)"

    def read(self, text: str) -> Union[int, str]:
        word = text.strip().lower()
        if word in ("node", "nodes"):
            return "nodes"
        try:
            return self.take(int(word))
        except ValueError:
            raise ValueError(f"dp_replicate must be {self.accepted}, got {text!r}") from None

    def take(self, value: Any) -> Union[int, str]:
        if isinstance(value, str):
            return self.read(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"dp_replicate must be {self.accepted}, got {value!r}")
        return value

    def show(self, value: Any) -> str:
        return str(value)

    flag_value = show


@dataclass(frozen=True)
class Plan:
    """A tensor-parallel plan: ``"auto"`` (the model's own) or a mapping of module-name patterns
    to ``"colwise"``/``"rowwise"``; in a variable, ``auto`` or the mapping as JSON."""

    accepted: str = 'auto, or a JSON object of module patterns to styles ({"blocks.*.w1": "colwise"})'

    def read(self, text: str) -> Union[str, Dict[str, str]]:
        if text.strip().lower() == "auto":
            return "auto"
        try:
            value = json.loads(text)
        except ValueError:
            raise ValueError(f"is not {self.accepted}") from None
        return self.take(value)

    def take(self, value: Any) -> Union[str, Dict[str, str]]:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, Mapping) and value and all(isinstance(k, str) and isinstance(v, str)
                                                         for k, v in value.items()):
            return dict(value)
        raise ValueError(f"is not {self.accepted}")

    def show(self, value: Any) -> str:
        return "" if value is None else value if isinstance(value, str) else json.dumps(value)

    flag_value = show


@dataclass(frozen=True)
class Names:
    """Some of ``values``, separated by commas or spaces (any case), or ``all`` (every one), or
    ``none`` (an empty tuple: none of them, said on purpose); in code also a list of names."""

    values: Tuple[str, ...]
    what: str

    @property
    def accepted(self) -> str:
        return f"{', '.join(self.values)} (several separated by commas), all or none"

    def read(self, text: str) -> Tuple[str, ...]:
        return self.take(text.replace(",", " ").split())

    def take(self, value: Any) -> Tuple[str, ...]:
        words = value.replace(",", " ").split() if isinstance(value, str) else value
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
            raise ValueError(f"takes {self.what} names: {self.accepted}")
        words = [w.strip().lower() for w in words]
        if words in (["none"], []):
            return ()
        if words == ["all"]:
            return ("all",)
        unknown = [w for w in words if w not in self.values]
        if unknown:
            raise ValueError(f"unknown {self.what} {unknown[0]!r}; use {self.accepted}")
        return tuple(dict.fromkeys(words))

    def show(self, value: Any) -> str:
        if value is None or isinstance(value, str):
            return value or ""
        return ",".join(value) if value else "none"

    flag_value = show


@dataclass(frozen=True)
class Stage:
    """A DeepSpeed ZeRO stage: 0, 1, 2 or 3 (in a variable, the digit)."""

    accepted: str = "0, 1, 2 or 3 (DeepSpeed's ZeRO stage)"

    def read(self, text: str) -> int:
        try:
            return self.take(int(text.strip()))
        except ValueError:
            raise ValueError(f"is not a ZeRO stage; use {self.accepted}") from None

    def take(self, value: Any) -> int:
        if isinstance(value, str):  # unified-dist launch --zero-stage hands its text on
            return self.read(value)
        if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2, 3):
            raise ValueError(f"is not a ZeRO stage; use {self.accepted}")
        return value

    def show(self, value: Any) -> str:
        return "" if value is None else str(value)

    flag_value = show


Kind = Union[Switch, Choice, Number, Text, Replicas, Plan, Names, Stage]


@dataclass(frozen=True)
class LauncherWord:
    """What a launcher may say about a setting: ``variable`` as its launcher exports it (spelled
    ``spelled`` on its command line). ``means`` translates its words into the setting's values
    (``None``: they read as the setting's own kind); the words in ``silent`` are its default, which it
    exports whether or not the user asked, so they say nothing."""

    variable: str
    spelled: str
    silent: Tuple[str, ...] = ()
    means: Optional[Mapping[str, Any]] = None


@dataclass(frozen=True)
class Setting:
    """One setting; see the module docstring.

    ``name`` is the ``ud.init`` keyword and :class:`~unified_dist.backends.Config` field when
    ``keyword``; ``variable`` its environment variable (``None``: code only); ``flag`` whether
    ``unified-dist launch --<name with dashes>`` sets it; ``launcher`` what a launcher may say;
    ``read_by`` who reads the variable (``"init"`` through :func:`resolve`; ``"detection"``;
    ``"trackers"``: :mod:`unified_dist.trackers`, through :func:`resolve`, not a ``Config`` field;
    ``"tools"``: the Makefile, the build and test tools); ``default_text`` shows the default when
    ``default`` is not what a user would read; ``error`` is the exception a bad value raises.
    """

    name: str
    variable: Optional[str]
    kind: Kind
    default: Any
    help: str
    keyword: bool = True
    flag: bool = True
    launcher: Optional[LauncherWord] = None
    read_by: str = "init"
    default_text: Optional[str] = None
    error: Type[Exception] = SettingError

    def accepted(self) -> str:
        """What the variable accepts, as one line of text."""
        return self.kind.accepted

    def shown_default(self) -> str:
        return self.default_text if self.default_text is not None else self.kind.show(self.default)

    def from_text(self, text: str, where: str) -> Any:
        """``text`` as this setting's value; ``where`` names its origin in the error."""
        try:
            return self.kind.read(text)
        except ValueError as exc:
            raise self.error(f"{where}={text!r} {_reason(exc)}") from None

    def from_code(self, value: Any) -> Any:
        """An ``init`` keyword's value, checked."""
        try:
            return self.kind.take(value)
        except ValueError as exc:
            raise self.error(f"init({self.name}={value!r}) {_reason(exc)}") from None

    def from_environment(self, environ: Mapping[str, str]) -> Any:
        """The variable's value, or the default when it is unset or empty."""
        text = environ.get(self.variable) if self.variable else None
        if text is None or not text.strip():
            return self.default
        return self.from_text(text, self.variable)

    def from_launcher(self, environ: Mapping[str, str]) -> Tuple[Any, Optional[str]]:
        """What the launcher said: ``(value, its text)``, or ``(None, None)`` when it said nothing."""
        word = self.launcher
        text = environ.get(word.variable) if word else None
        if word is None or text is None or text.strip().lower() in word.silent:
            return None, None
        if word.means is not None:
            if text.strip().lower() not in word.means:
                raise self.error(f"{word.variable}={text!r} ({word.spelled}) is not one of "
                                 f"{', '.join(word.means)}")
            return word.means[text.strip().lower()], text
        return self.from_text(text, f"{word.variable} ({word.spelled})"), text


def _reason(exc: ValueError) -> str:
    """An error of a kind as the tail of a sentence that starts with the value."""
    text = str(exc)
    return text if text.startswith(("is ", "takes ")) else f": {text}"


# ---------------------------------------------------------------------- the table
def _declare(*rows: Setting) -> Dict[str, Setting]:
    return {row.name: row for row in rows}


TABLE: Dict[str, Setting] = _declare(
    Setting("backend", "UNIFIED_DIST_BACKEND", Choice(BACKEND_NAMES, "backend"), None,
            "the backend to drive, whatever the launcher's variables say (ud.launch sets it in its workers)",
            flag=False, read_by="detection", default_text="detected from the launcher"),
    Setting("mixed_precision", "UNIFIED_DIST_MIXED_PRECISION", Choice(("no", "bf16", "fp16"), "mixed precision"), "no",
            "autocast mode (fp16 needs a CUDA GPU)", error=PrecisionError,
            launcher=LauncherWord("ACCELERATE_MIXED_PRECISION", "accelerate launch --mixed_precision", silent=("no",))),
    Setting("gradient_accumulation_steps", "UNIFIED_DIST_GRADIENT_ACCUMULATION_STEPS",
            Number("micro-batches", "gradient_accumulation_steps", integer=True), 1,
            "micro-batches per optimizer step (ud.accumulate)",
            launcher=LauncherWord("ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                                  "accelerate launch --gradient_accumulation_steps", silent=("1",))),
    Setting("timeout", "UNIFIED_DIST_TIMEOUT", Number("seconds", "timeout"), 600.0,
            "how long one collective may wait for the other ranks before it fails"),
    Setting("debug", "UNIFIED_DIST_DEBUG", Switch(), False,
            "check mode: ranks compare each collective's signature before running it",
            launcher=LauncherWord("ACCELERATE_DEBUG_MODE", "accelerate launch --debug", silent=("false", "0", ""))),
    Setting("sharding", "UNIFIED_DIST_SHARDING", Choice(("no", "fsdp"), "sharding"), "no",
            "fsdp: ud.prepare shards models with FSDP2 (torch, accelerate)",
            launcher=LauncherWord("ACCELERATE_USE_FSDP", "accelerate launch --use_fsdp", silent=("false", "0", ""),
                                  means={"true": "fsdp", "1": "fsdp"})),
    Setting("shard_modules", None, Text("classes or class names"), None,
            "the blocks FSDP2 shards one by one (default: a model's _no_split_modules, else ModuleList children)",
            flag=False, default_text="chosen from the model"),
    Setting("reshard_after_forward", None, Switch(), True,
            "False keeps FSDP2's parameters gathered from forward to backward (more memory, one all-gather less)",
            flag=False, launcher=LauncherWord("FSDP_RESHARD_AFTER_FORWARD",
                                              "accelerate launch --fsdp_reshard_after_forward", silent=("true",))),
    Setting("dp_replicate", "UNIFIED_DIST_DP_REPLICATE", Replicas(), 1,
            "HSDP: replicas of the sharded model (shard inside each, replicate across); nodes: one per machine",
            launcher=LauncherWord("PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
                                  "accelerate launch --parallelism_config_dp_replicate_size", silent=("1",))),
    Setting("tp", "UNIFIED_DIST_TP", Number("ranks", "tp", integer=True), 1,
            "tensor parallel: ranks that split each layer of tp_plan (the data-parallel ranks are world / tp)",
            launcher=LauncherWord("PARALLELISM_CONFIG_TP_SIZE", "accelerate launch --parallelism_config_tp_size",
                                  silent=("1",))),
    Setting("tp_plan", "UNIFIED_DIST_TP_PLAN", Plan(), None,
            "which layers tensor parallelism splits: auto (the model's own plan) or {pattern: colwise|rowwise}",
            default_text="auto when tp > 1"),
    Setting("cpu_offload", "UNIFIED_DIST_CPU_OFFLOAD", Switch(), False,
            "FSDP2 keeps parameters, gradients and optimizer state in CPU memory between uses",
            launcher=LauncherWord("FSDP_OFFLOAD_PARAMS", "accelerate launch --fsdp_offload_params",
                                  silent=("false", "0", ""))),
    Setting("activation_checkpointing", "UNIFIED_DIST_ACTIVATION_CHECKPOINTING", Switch(), False,
            "recompute each sharded block's activations in backward instead of keeping them",
            launcher=LauncherWord("FSDP_ACTIVATION_CHECKPOINTING", "accelerate launch --fsdp_activation_checkpointing",
                                  silent=("false", "0", ""))),
    Setting("pp", "UNIFIED_DIST_PP", Number("stages", "pp", integer=True), 1,
            "pipeline parallel: stages the model is cut into, one per rank group (train with ud.pipeline_step)"),
    Setting("pp_schedule", "UNIFIED_DIST_PP_SCHEDULE", Choice(("gpipe", "1f1b", "interleaved1f1b", "loopedbfs",
                                                               "interleavedzerobubble", "zbvzerobubble", "dualpipev"),
                                                              "pipeline schedule"), "1f1b",
            "the pipeline's schedule: gpipe or 1f1b (the interleaved and zero-bubble ones are refused)"),
    Setting("pp_microbatches", "UNIFIED_DIST_PP_MICROBATCHES", Number("microbatches", "pp_microbatches",
                                                                      integer=True), None,
            "microbatches per pipeline step (at least the stages; they must divide the batch)",
            default_text="the number of stages"),
    Setting("pp_split", None, Text("unit names"), None,
            "the units (fully-qualified names) that begin pipeline stages 1..pp-1 (default: the largest "
            "ModuleList's layers cut evenly)", flag=False, default_text="the layers cut evenly"),
    Setting("sync_batchnorm", "UNIFIED_DIST_SYNC_BATCHNORM", Switch(), False,
            "ud.prepare makes BatchNorm layers compute statistics over the global batch"),
    Setting("gradient_compression", "UNIFIED_DIST_GRADIENT_COMPRESSION",
            Choice(("bf16", "fp16"), "gradient compression", nothing=("none", "no", "off")), None,
            "the format gradients travel in for the all-reduce (DDP's hook, Horovod's compressor)"),
    Setting("bucket_mb", "UNIFIED_DIST_BUCKET_MB", Number("MiB", "bucket size"), None,
            "size of one fused gradient reduction: DDP's buckets, Horovod's fusion buffer "
            "(horovodrun --fusion-threshold-mb must agree)", default_text="each stack's own (DDP 25, Horovod 128)"),
    Setting("bucket_view", "UNIFIED_DIST_BUCKET_VIEW", Switch(), True,
            "DDP keeps gradients as views into its buckets; off for code that replaces .grad in place"),
    Setting("check_finite", "UNIFIED_DIST_CHECK_FINITE", Switch(), True,
            "every rank stops at the same optimizer step when any rank's loss was NaN/inf (one tiny exchange "
            "per optimizer step, none on micro-steps that only accumulate)"),
    Setting("compile", "UNIFIED_DIST_COMPILE", Compiler(), None,
            "ud.prepare compiles models with torch.compile (the module DDP wraps, whole; FSDP2's blocks one by one)",
            launcher=LauncherWord("ACCELERATE_DYNAMO_BACKEND", "accelerate launch --dynamo_backend", silent=("no",))),
    Setting("compile_mode", "UNIFIED_DIST_COMPILE_MODE",
            Choice(("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"), "compile mode"),
            "default", "torch.compile's mode when compile is on",
            launcher=LauncherWord("ACCELERATE_DYNAMO_MODE", "accelerate launch --dynamo_mode", silent=("default",))),
    Setting("stop_signals", "UNIFIED_DIST_STOP_SIGNALS", Signals(), ("SIGUSR1", "SIGTERM"),
            "the signals ud.should_stop() turns into one agreed stop (SLURM --signal, scancel, torchrun, Kubernetes)"),
    Setting("log_with", "UNIFIED_DIST_LOG_WITH", Names(TRACKER_NAMES, "tracker"), None,
            "the experiment trackers ud.log and ud.log_hparams write to, from the main process (docs/trackers.md)",
            read_by="trackers", default_text="not chosen (ud.log refuses)"),
    Setting("project_dir", "UNIFIED_DIST_PROJECT_DIR", Text("a directory"), "runs",
            "where the trackers write (event files, mlruns/, wandb/, metrics.jsonl)", read_by="trackers"),
    Setting("zero_stage", "UNIFIED_DIST_ZERO_STAGE", Stage(), None,
            "the deepspeed backend's ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters",
            launcher=LauncherWord("ACCELERATE_DEEPSPEED_ZERO_STAGE", "accelerate launch --zero_stage"),
            default_text="the DeepSpeed config's, else 2 under accelerate launch --use_deepspeed, else 0"),
    Setting("deepspeed_config", "UNIFIED_DIST_DEEPSPEED_CONFIG", Text("a DeepSpeed config file (JSON)"), None,
            "the deepspeed backend starts from this DeepSpeed config; the settings fill what it leaves out and "
            "must agree with what it says",
            launcher=LauncherWord("ACCELERATE_DEEPSPEED_CONFIG_FILE", "accelerate launch --deepspeed_config_file"),
            default_text="none (built from the settings)"),
    Setting("offload_optimizer", "UNIFIED_DIST_OFFLOAD_OPTIMIZER",
            Choice(("cpu",), "offload device", nothing=("none",)), None,
            "the deepspeed backend keeps ZeRO's float32 master weights and optimizer state in CPU memory and "
            "steps the optimizer there (ZeRO 1-3)",
            launcher=LauncherWord("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
                                  "accelerate launch --offload_optimizer_device", silent=("none",)),
            default_text="the DeepSpeed config's, else none"),
    Setting("offload_param", "UNIFIED_DIST_OFFLOAD_PARAM", Choice(("cpu",), "offload device", nothing=("none",)),
            None, "the deepspeed backend's ZeRO-3 keeps each rank's parameter partition in CPU memory between uses",
            launcher=LauncherWord("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
                                  "accelerate launch --offload_param_device", silent=("none",)),
            default_text="the DeepSpeed config's, else none"),
    Setting("gradient_clipping", "UNIFIED_DIST_GRADIENT_CLIPPING", Number("max norm", "gradient_clipping"), None,
            "the deepspeed backend clips every optimizer step's gradients to this 2-norm inside DeepSpeed's step "
            "(on every backend, ud.clip_grad_norm_ clips where the loop calls it)",
            launcher=LauncherWord("ACCELERATE_GRADIENT_CLIPPING", "accelerate launch --gradient_clipping",
                                  silent=("auto", "none", "0", "0.0")),
            default_text="the DeepSpeed config's, else none"),
    Setting("slurm", "UNIFIED_DIST_SLURM", Switch(), True,
            "detection reads srun's variables (off: srun -n N without torchrun is refused)",
            keyword=False, flag=False, read_by="detection"),
    Setting("launcher", "UNIFIED_DIST_LAUNCHER", Text("a launcher's name"), None,
            "set by ud.launch in its workers: the name ud.launcher() reports",
            keyword=False, flag=False, read_by="detection", default_text="the detected launcher"),
    Setting("wheel_cache", "UNIFIED_DIST_WHEEL_CACHE", Text("a directory"), None,
            "where `make setup` (tools/build_horovod.sh) keeps the Horovod wheel it builds",
            keyword=False, flag=False, read_by="tools",
            default_text="$XDG_CACHE_HOME (or ~/.cache)/unified_dist/wheels"),
    Setting("without_horovod", "UNIFIED_DIST_WITHOUT_HOROVOD", Text("1 for on; anything else off"), None,
            "1: `make setup` leaves Horovod out and the test suite skips its tests",
            keyword=False, flag=False, read_by="tools", default_text="off"),
    Setting("test_times", "UNIFIED_DIST_TEST_TIMES", Text("a file"), None,
            "where the test suite writes each test's seconds per phase (`make test`: build/test-times.json, "
            "which bench/suite_time/suite_time.py sums into the suite's budget)",
            keyword=False, flag=False, read_by="tools", default_text="none (not written)"),
    Setting("launch_log", "UNIFIED_DIST_LAUNCH_LOG", Text("a file"), None,
            "where the tests' launches each append a line: the test, the launcher, the script, its wall and CPU "
            "seconds (`make test`: build/launches.jsonl, which bench/suite_time/suite_time.py --launches sums)",
            keyword=False, flag=False, read_by="tools", default_text="none (not written)"),
)
"""Every setting, in the order ``unified-dist env`` lists them."""

SETTINGS: Dict[str, Setting] = {s.variable: s for s in TABLE.values() if s.variable}
"""The settings that have an environment variable, by variable."""

RESOLVED: Tuple[str, ...] = tuple(name for name, s in TABLE.items() if s.keyword and s.read_by == "init")
"""The keywords :func:`resolve_all` resolves: the fields of :class:`~unified_dist.backends.Config`
(``backend`` is resolved by detection)."""

FLAGS: Tuple[str, ...] = tuple(name for name, s in TABLE.items() if s.flag and s.variable)
"""The settings ``unified-dist launch`` has a flag for (it hands them to the script as variables)."""

BACKEND_ENV = TABLE["backend"].variable
LAUNCHER_ENV = TABLE["launcher"].variable
SLURM_ENV = TABLE["slurm"].variable
TIMEOUT_ENV = TABLE["timeout"].variable


# ---------------------------------------------------------------------- resolution
def resolve(name: str, given: Any, environ: Mapping[str, str]) -> Any:
    """Setting ``name``'s value: ``given`` (the ``init`` keyword; ``None``: not given) > what the
    launcher said > the environment variable > the default.

    Raises the setting's error (a :class:`SettingError` unless the table says otherwise) for a
    value that does not read, and :class:`LaunchError` when ``given`` contradicts the launcher.
    """
    setting = TABLE[name]
    code = None if given is None else setting.from_code(given)  # "none" in code says None: still said
    said, text = setting.from_launcher(environ)
    if given is not None and said is not None and code != said:
        raise LaunchError(f"init({name}={given!r}) contradicts {setting.launcher.spelled} "
                          f"({setting.launcher.variable}={text}); drop one of them")
    if given is not None:
        return code
    if said is not None:
        return said
    return setting.from_environment(environ)


def resolve_all(given: Mapping[str, Any], environ: Mapping[str, str]) -> Dict[str, Any]:
    """Every keyword of :data:`RESOLVED`, resolved by :func:`resolve` from ``given`` (the ``init``
    keywords; missing or ``None``: not given). Raises for a name ``given`` holds that no setting has."""
    unknown = sorted(set(given) - set(RESOLVED))
    if unknown:
        raise SettingError(f"init() has no setting {', '.join(unknown)}; `unified-dist env` lists them")
    return {name: resolve(name, given.get(name), environ) for name in RESOLVED}


def flag_environment(values: Mapping[str, Any]) -> Dict[str, str]:
    """The variables that hand the settings in ``values`` (name -> value, ``None``: not given) to a
    script, as ``unified-dist launch`` does for its flags."""
    unknown = sorted(set(values) - set(FLAGS))
    if unknown:
        raise SettingError(f"no launch flag for {', '.join(unknown)}")
    return {TABLE[name].variable: TABLE[name].kind.flag_value(values[name])
            for name in FLAGS if values.get(name) is not None}


# ---------------------------------------------------------------------- unknown names
def unknown_variables(environ: Mapping[str, str]) -> List[Tuple[str, Optional[str]]]:
    """Each ``UNIFIED_DIST_*`` name in ``environ`` (in any case) that no setting declares, with the
    closest declared name (``None`` when none is close), sorted by name. Pure."""
    suffixes = {name[len(PREFIX):]: name for name in SETTINGS}
    found = []
    for name in sorted(environ):
        if not name.upper().startswith(PREFIX) or name in SETTINGS:
            continue
        # Compare what follows the prefix: the shared prefix alone would make every name "close".
        close = difflib.get_close_matches(name[len(PREFIX):].upper(), list(suffixes), n=1, cutoff=0.6)
        found.append((name, suffixes[close[0]] if close else None))
    return found


def describe_unknown(name: str, suggestion: Optional[str]) -> str:
    """One line about an unknown variable, for ``ud.init``'s warning and ``unified-dist env``."""
    hint = f"did you mean {suggestion}?" if suggestion else "`unified-dist env` lists the known ones"
    return f"{name} is not a unified_dist setting and is ignored; {hint}"


_warned: Set[str] = set()


def warn_unknown(environ: Mapping[str, str], stacklevel: int = 3) -> List[Tuple[str, Optional[str]]]:
    """Warn (``UserWarning``, once per process for each name) about the unknown ``UNIFIED_DIST_*``
    variables in ``environ``; return all of them, as :func:`unknown_variables` does.

    ``stacklevel`` 3 points the warning at the caller of the function that calls this one
    (``ud.init``'s caller).
    """
    unknown = unknown_variables(environ)
    fresh = [(name, suggestion) for name, suggestion in unknown if name not in _warned]
    if fresh:
        _warned.update(name for name, _ in fresh)
        warnings.warn("unified_dist: " + "; ".join(describe_unknown(*item) for item in fresh),
                      UserWarning, stacklevel=stacklevel)
    return unknown


def in_effect(environ: Mapping[str, str]) -> List[Dict[str, Optional[str]]]:
    """Every setting that has a variable, as ``environ`` gives it: ``variable``, ``value`` (the
    variable's text, or the default), ``source`` (``"environment"`` or ``"default"``), ``keyword``
    (the ``ud.init`` keyword that overrides it in a script, or ``None``), ``flag`` (the
    ``unified-dist launch`` flag, or ``None``), ``accepted``, ``help``, and ``problem`` (the error a
    value that does not read would raise, else ``None``). JSON-ready."""
    rows = []
    for setting in SETTINGS.values():
        value = environ.get(setting.variable)
        rows.append({"variable": setting.variable,
                     "value": setting.shown_default() if value is None else value,
                     "source": "default" if value is None else "environment",
                     "keyword": setting.name if setting.keyword else None,
                     "flag": flag_name(setting.name) if setting.name in FLAGS else None,
                     "accepted": setting.accepted(), "help": setting.help,
                     "problem": _problem(setting, environ) if value is not None else None})
    return rows


def flag_name(name: str) -> str:
    """``unified-dist launch``'s flag for setting ``name``: ``--`` and the name with dashes."""
    return "--" + name.replace("_", "-")


def _problem(setting: Setting, environ: Mapping[str, str]) -> Optional[str]:
    if setting.read_by == "tools" or isinstance(setting.kind, Text):
        return None
    try:
        setting.from_environment(environ)
    except Exception as exc:  # the setting's own error class
        return str(exc)
    return None


__all__ = ["TABLE", "SETTINGS", "RESOLVED", "FLAGS", "Setting", "Switch", "Choice", "Number", "Text", "Replicas",
           "Plan", "Names", "Stage", "LauncherWord", "resolve", "resolve_all", "flag_environment", "unknown_variables",
           "describe_unknown", "warn_unknown", "in_effect", "flag_name", "PREFIX"]
