"""The deepspeed backend's pure parts: which launcher selects it, where its ZeRO stage comes from, the engine
config built from the settings, and its one-line refusals (issue 59). Its physics run under torchrun,
``deepspeed``, ``accelerate launch --use_deepspeed`` and ``unified-dist launch`` in
tests/launchers/test_deepspeed_engine.py."""
import datetime

import pytest

import unified_dist as ud
from unified_dist import settings
from unified_dist.backends.base import Config
from unified_dist.backends.deepspeed_backend import engine_config, refusal
from unified_dist.detection import detect
from unified_dist.errors import LaunchError, SettingError
from unified_dist.parallel.sharding import Sharding

TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
# what `deepspeed --num_gpus 2 script.py` gives rank 1 (seen from deepspeed 0.19.8's launcher here)
DEEPSPEED = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
             "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": "2"}
# what `accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2` gives rank 1 on a CPU (Accelerate 1.15)
ACCELERATE_DS = dict(TORCHRUN, TORCHELASTIC_RUN_ID="none", ACCELERATE_MIXED_PRECISION="no",
                     ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="2",
                     ACCELERATE_CONFIG_DS_FIELDS="")


@pytest.mark.parametrize("env, explicit, launcher", [
    (DEEPSPEED, None, "deepspeed"),                                    # DeepSpeed's own launcher
    (ACCELERATE_DS, None, "accelerate"),                               # accelerate launch --use_deepspeed
    (TORCHRUN, "deepspeed", "torchrun"),                               # ud.init(backend="deepspeed")
    (dict(TORCHRUN, UNIFIED_DIST_BACKEND="deepspeed"), None, "torchrun"),  # the variable
])
def test_each_selector_chooses_the_deepspeed_engine(env, explicit, launcher):
    found = detect(env, explicit)
    assert (found.backend, found.launcher, found.world_size, found.rank, found.problems) == (
        "deepspeed", launcher, 2, 1, ())


# rank 1 of 2 on one host, as horovodrun --gloo, srun (one node) and Open MPI's mpirun give it (values seen here)
HOROVODRUN = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
              "HOROVOD_CROSS_SIZE": "1", "HOROVOD_CONTROLLER": "gloo", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
              "HOROVOD_GLOO_RENDEZVOUS_PORT": "41234"}
SRUN = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "vm", "SLURM_NODELIST": "vm", "SLURM_STEP_NUM_NODES": "1"}
MPIRUN = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "1632960513"}


@pytest.mark.parametrize("env, launcher", [(HOROVODRUN, "horovodrun"), (SRUN, "srun"), (MPIRUN, "mpirun")])
@pytest.mark.parametrize("how", ["code", "variable"])
def test_the_engine_joins_the_processes_another_stacks_launcher_started(env, launcher, how):
    """ud.init(backend="deepspeed") (or UNIFIED_DIST_BACKEND=deepspeed) where horovodrun, srun or mpirun started the
    processes: the deepspeed backend over a torch group of the launcher's processes, each at the rank its launcher
    gave it, with a rendezvous of its own (horovodrun's is Horovod's; srun and mpirun give none). The launches:
    tests/launchers/test_deepspeed_engine.py."""
    found = detect(env, "deepspeed") if how == "code" else detect(dict(env, UNIFIED_DIST_BACKEND="deepspeed"))
    assert (found.backend, found.launcher, found.world_size, found.rank, found.local_rank, found.problems) == (
        "deepspeed", launcher, 2, 1, 1, ())
    assert found.master_addr and found.master_port


def test_torchrun_alone_stays_torch():
    assert detect(TORCHRUN).backend == "torch"


@pytest.mark.parametrize("env, explicit", [(ACCELERATE_DS, "accelerate"), (ACCELERATE_DS, "torch"),
                                           (dict(ACCELERATE_DS, UNIFIED_DIST_BACKEND="accelerate"), None)])
def test_another_backend_under_use_deepspeed_is_refused_in_one_line(env, explicit):
    found = detect(env, explicit)
    assert len(found.problems) == 1 and "\n" not in found.problems[0]
    assert "--use_deepspeed" in found.problems[0] and "without DeepSpeed" in found.problems[0]


def test_the_stage_comes_from_one_place_code_then_launcher_then_variable():
    stage = settings.TABLE["zero_stage"]
    assert settings.resolve("zero_stage", None, {}) is None
    assert settings.resolve("zero_stage", None, {stage.variable: "3"}) == 3
    assert settings.resolve("zero_stage", None, dict(ACCELERATE_DS, **{stage.variable: "3"})) == 2  # launcher first
    assert settings.resolve("zero_stage", 2, ACCELERATE_DS) == 2
    assert stage.from_code("3") == 3  # unified-dist launch --zero-stage 3 checks its text the same way
    with pytest.raises(LaunchError, match="accelerate launch --zero_stage"):
        settings.resolve("zero_stage", 3, ACCELERATE_DS)
    for bad in ("4", "two"):
        with pytest.raises(SettingError, match="ZeRO stage") as err:
            settings.resolve("zero_stage", None, {stage.variable: bad})
        assert "\n" not in str(err.value)
    with pytest.raises(SettingError, match="ZeRO stage"):
        settings.resolve("zero_stage", 5, {})


def test_engine_config_is_built_from_the_settings():
    config = engine_config({}, None, stage=3, accumulation=2, mixed_precision="bf16", micro_batch=4)
    assert config["zero_optimization"] == {"stage": 3}
    assert (config["gradient_accumulation_steps"], config["train_micro_batch_size_per_gpu"]) == (2, 4)
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert config["gradient_clipping"] == 0.0  # DeepSpeed's default (1.0) would clip where no backend does
    assert "train_batch_size" not in config


def test_a_config_file_is_filled_where_it_says_auto_and_refused_where_it_disagrees():
    file = {"zero_optimization": {"stage": "auto", "overlap_comm": True}, "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": 0.5}
    config = engine_config(file, "ds.json", stage=2, accumulation=4, mixed_precision="no", micro_batch=8)
    assert config["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert config["gradient_accumulation_steps"] == 4 and config["gradient_clipping"] == 0.5
    assert file["zero_optimization"]["stage"] == "auto"  # the user's dict is not changed
    with pytest.raises(SettingError, match="ds.json says zero_optimization.stage=1 but zero_stage says 3") as err:
        engine_config({"zero_optimization": {"stage": 1}}, "ds.json", 3, 1, "no", 4)
    assert "\n" not in str(err.value)


def test_offload_and_clipping_come_from_the_settings_and_agree_with_the_file():
    """The settings' offload devices and clipping go where DeepSpeed reads them; the user's torch optimizer steps
    the offloaded partitions (``zero_force_ds_cpu_optimizer`` off unless the file says it); a file that says the same
    is taken, one that says otherwise is refused in one line."""
    config = engine_config({}, None, 3, 1, "no", 4, offload_optimizer="cpu", offload_param="cpu", gradient_clipping=0.5)
    assert config["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                           "offload_param": {"device": "cpu"}}
    assert config["gradient_clipping"] == 0.5 and config["zero_force_ds_cpu_optimizer"] is False
    plain = engine_config({}, None, 2, 1, "no", 4)
    assert "offload_optimizer" not in plain["zero_optimization"] and "zero_force_ds_cpu_optimizer" not in plain
    file = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
            "zero_force_ds_cpu_optimizer": True, "gradient_clipping": "auto"}
    config = engine_config(file, "ds.json", 2, 1, "no", 4, offload_optimizer="cpu", gradient_clipping=1.0)
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert config["zero_force_ds_cpu_optimizer"] is True and config["gradient_clipping"] == 1.0  # the file's word
    disagreements = (({"offload_optimizer": "cpu"}, "offload_optimizer.device='none' but offload_optimizer says 'cpu'"),
                     ({"gradient_clipping": 0.5}, "ds.json says gradient_clipping=1.0 but gradient_clipping says 0.5"))
    for said, words in disagreements:
        with pytest.raises(SettingError, match=words) as err:
            engine_config({"zero_optimization": {"offload_optimizer": {"device": "none"}}, "gradient_clipping": 1.0},
                          "ds.json", 2, 1, "no", 4, **said)
        assert "\n" not in str(err.value)


def test_an_offload_the_stage_cannot_do_stops_ud_init_before_any_model_is_built(monkeypatch):
    """``ud.init(backend="deepspeed", zero_stage=2, offload_param="cpu")``: the one line at ``ud.init``, before the
    group is joined, not at ``ud.prepare`` after the model and data are built."""
    for name in ("UNIFIED_DIST_BACKEND", "UNIFIED_DIST_ZERO_STAGE", "RANK", "WORLD_SIZE", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)
    ud.shutdown()
    try:
        with pytest.raises(SettingError, match="offload_param='cpu' offloads ZeRO-3's parameter partitions"):
            ud.init(backend="deepspeed", zero_stage=2, offload_param="cpu")
        import torch.distributed as dist

        assert not dist.is_initialized()
    finally:
        ud.shutdown()


def test_offload_comes_from_the_setting_else_the_file_and_a_null_entry_is_filled():
    from unified_dist.backends.deepspeed_backend import offload_devices

    file = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "none"}}}
    assert offload_devices(file, Config()) == {"offload_optimizer": "cpu"}
    assert offload_devices({}, Config(offload_param="cpu")) == {"offload_param": "cpu"}
    assert offload_devices({"zero_optimization": {"offload_optimizer": None}}, Config()) == {}
    config = engine_config({"zero_optimization": {"offload_optimizer": None}}, "ds.json", 2, 1, "no", 4,
                           offload_optimizer="cpu")
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


@pytest.mark.parametrize("file, stage, settings_said, words", [
    ({}, 2, {"offload_param": "cpu"}, "offload_param='cpu' offloads ZeRO-3's parameter partitions, and ZeRO stage 2"),
    ({"zero_optimization": {"offload_param": {"device": "cpu"}}}, 1, {}, "use zero_stage=3, or drop it"),
    ({}, 0, {"offload_optimizer": "cpu"}, "offload_optimizer='cpu' offloads ZeRO's optimizer partitions, and stage 0"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, 0, {}, "use zero_stage=1, 2 or 3"),
])
def test_offload_a_stage_has_nothing_for_is_refused_in_one_line(file, stage, settings_said, words):
    """DeepSpeed offloads parameters at ZeRO-3 only and optimizer partitions at ZeRO 1-3; elsewhere it would run
    without the offload the user asked for, without a word. The same line at ``ud.init`` (before the model and data
    are built: :func:`offload_problem` of what the settings and the file say) and at ``ud.prepare``."""
    from unified_dist.backends.deepspeed_backend import offload_devices, offload_problem

    with pytest.raises(SettingError, match=words) as err:
        engine_config(file, "ds.json", stage, 1, "no", 4, **settings_said)
    assert "\n" not in str(err.value)
    assert offload_problem(offload_devices(file, Config(**settings_said)), stage) == str(err.value)


def test_accelerates_offload_and_clipping_words_reach_the_settings():
    """``accelerate launch --use_deepspeed --offload_optimizer_device cpu --offload_param_device cpu
    --gradient_clipping 0.5`` (the variables it exports); ``none`` is its default and says nothing; a device the
    backend does not offload to (``nvme``) is one line naming what it takes."""
    words = dict(ACCELERATE_DS, ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE="cpu",
                 ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE="cpu", ACCELERATE_GRADIENT_CLIPPING="0.5")
    assert [settings.resolve(name, None, words) for name in ("offload_optimizer", "offload_param",
                                                              "gradient_clipping")] == ["cpu", "cpu", 0.5]
    silent = dict(ACCELERATE_DS, ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE="none")
    assert settings.resolve("offload_optimizer", None, silent) is None
    for unsaid in ("auto", "0.0"):  # Accelerate's own default, and --gradient_clipping 0 (no clipping)
        assert settings.resolve("gradient_clipping", None, dict(ACCELERATE_DS, ACCELERATE_GRADIENT_CLIPPING=unsaid)) \
            is None
    assert settings.resolve("offload_optimizer", None, {"UNIFIED_DIST_OFFLOAD_OPTIMIZER": "cpu"}) == "cpu"
    with pytest.raises(SettingError, match="nvme.*use one of cpu, none") as err:
        settings.resolve("offload_optimizer", None, dict(ACCELERATE_DS,
                                                         ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE="nvme"))
    assert "\n" not in str(err.value)


def test_accelerates_deepspeed_words_that_are_not_settings_are_refused_or_said():
    """``--deepspeed_moe_layer_cls_names`` is refused in one line; ``--zero3_init_flag true`` and
    ``--zero3_save_16bit_model true`` at ZeRO-3 are said in one line each (Accelerate's defaults, false or unset,
    say nothing; below ZeRO-3 Accelerate ignores both too)."""
    from unified_dist.backends.deepspeed_backend import accelerate_words

    assert accelerate_words(ACCELERATE_DS, 3) == (None, [])
    moe = dict(ACCELERATE_DS, ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES="MixtralSparseMoeBlock")
    problem, _ = accelerate_words(moe, 3)
    assert problem.startswith("accelerate launch --deepspeed_moe_layer_cls_names MixtralSparseMoeBlock: the deepspeed "
                              "backend does not mark MoE layers") and "\n" not in problem
    assert "deepspeed.utils.set_z3_leaf_modules(model, [those classes]) before ud.prepare" in problem
    assert accelerate_words(moe, 2) == (None, [])  # leaf modules are ZeRO-3's: below it DeepSpeed reads none
    both = dict(ACCELERATE_DS, ACCELERATE_DEEPSPEED_ZERO3_INIT="true",
                ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL="true")
    problem, notes = accelerate_words(both, 3)
    assert problem is None and len(notes) == 2 and all("\n" not in note for note in notes)
    assert notes[0].startswith("accelerate launch --zero3_init_flag true: a facade script builds its model whole")
    assert notes[1].startswith("accelerate launch --zero3_save_16bit_model true: ud.save writes the float32 weights")
    assert accelerate_words(both, 2) == (None, [])
    assert accelerate_words(dict(ACCELERATE_DS, ACCELERATE_DEEPSPEED_ZERO3_INIT="false"), 3) == (None, [])


@pytest.mark.parametrize("config, words", [
    (Config(sharding=Sharding("fsdp")), "sharding='fsdp' is torch's FSDP2/TP/pipeline layout"),
    (Config(sharding=Sharding(pp=2)), "pp=2 is torch's FSDP2/TP/pipeline layout; the deepspeed backend shards"),
    (Config(gradient_compression="bf16"), "DeepSpeed reduces in its own format"),
    (Config(bucket_mb=10.0), "reduce_bucket_size"),
    (Config(compile="inductor"), "does not compile yet"),
])
def test_what_the_engine_cannot_do_is_refused_in_one_line(config, words):
    problem = refusal(config)
    assert words in problem and "\n" not in problem
    assert refusal(Config(timeout=datetime.timedelta(seconds=5))) is None


def test_other_backends_refuse_the_deepspeed_settings(monkeypatch):
    for name in ("UNIFIED_DIST_BACKEND", "UNIFIED_DIST_ZERO_STAGE", "RANK", "WORLD_SIZE", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)
    ud.shutdown()
    try:
        for kwargs in ({"zero_stage": 2}, {"deepspeed_config": "ds.json"}, {"offload_optimizer": "cpu"},
                       {"offload_param": "cpu"}, {"gradient_clipping": 1.0}):
            with pytest.raises(ud.UnifiedDistError, match="backend='deepspeed'") as err:
                ud.init(**kwargs)
            assert "\n" not in str(err.value) and str(err.value).startswith(next(iter(kwargs)))
    finally:
        ud.shutdown()


def test_the_accelerate_api_tells_accelerates_deepspeed_path_gloo_and_keeps_the_users_handler():
    """``unified_dist.accelerate.Accelerator`` with a DeepSpeed plugin (or under ``accelerate launch
    --use_deepspeed``) on several CPU processes: Accelerate's DeepSpeed path gets the backend gloo, through the
    user's own ``InitProcessGroupKwargs`` (its other fields kept) or a new one; nothing else asks for DeepSpeed.
    The launches: tests/launchers/test_accelerate_deepspeed.py."""
    import datetime

    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    from unified_dist.accelerate import accelerator, world

    assert world.launcher_world(ACCELERATE_DS).world_size == 2  # the world is read as before
    mine = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=7))
    told = accelerator._over_gloo([mine])
    assert [h.to_kwargs() for h in told] == [{"backend": "gloo", "timeout": datetime.timedelta(seconds=7)}]
    assert [h.to_kwargs()["backend"] for h in accelerator._over_gloo(None)] == ["gloo"]
    assert accelerator._asks_for_deepspeed({"deepspeed_plugin": DeepSpeedPlugin(zero_stage=2)})
    assert accelerator._asks_for_deepspeed({"deepspeed_plugins": {"a": DeepSpeedPlugin(zero_stage=2)}})
    assert not accelerator._asks_for_deepspeed({"deepspeed_plugin": None})


def test_the_accelerate_api_refuses_a_deepspeed_plugin_that_accelerate_would_leave_out(monkeypatch):
    """``Accelerator(cpu=True, deepspeed_plugin=...)``: Accelerate sets up plain CPU training and ignores the
    plugin; refused in one line, never trained without DeepSpeed."""
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    from unified_dist.accelerate import Accelerator
    from unified_dist.accelerate.accelerator import DeepSpeedLeftOutError

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # restored after: Accelerate writes "true"
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with pytest.raises(DeepSpeedLeftOutError, match="drop cpu=True") as err:
            Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
        assert "\n" not in str(err.value)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_the_accelerate_api_refuses_a_dummy_optimizer_without_deepspeed(monkeypatch):
    """``DummyOptim``/``DummyScheduler`` (a DeepSpeed config's optimizer and scheduler sections) prepared where
    Accelerate set up no DeepSpeed: Accelerate hands them back as they are (nothing would build the optimizer);
    refused in one line before anything is prepared."""
    import torch
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DummyOptim, DummyScheduler

    from unified_dist.accelerate import Accelerator
    from unified_dist.accelerate.accelerator import DeepSpeedLeftOutError

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(2, 1)
        optimizer = DummyOptim(model.parameters(), lr=0.1)
        for given, name in (((model, optimizer), "DummyOptim"), ((DummyScheduler(optimizer),), "DummyScheduler")):
            with pytest.raises(DeepSpeedLeftOutError, match=f"{name} stands for a DeepSpeed config") as err:
                accelerator.prepare(*given)
            assert "\n" not in str(err.value)
        real = torch.optim.SGD(model.parameters(), lr=0.1)
        assert len(accelerator.prepare(model, real)) == 2  # what Accelerate prepares itself goes through
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_launch_command_starts_deepspeeds_launcher_on_one_node_and_torchrun_on_several():
    from unified_dist.cli import launch

    one = launch.build(launch.Plan(backend="deepspeed", script="train.py", nproc=2, master_port=29601,
                                   settings={"zero_stage": 3}), environ={})
    assert one.argv == ("deepspeed", "--num_gpus", "2", "--no_local_rank", "--master_port", "29601", "train.py")
    assert one.env["UNIFIED_DIST_ZERO_STAGE"] == "3"
    two = launch.build(launch.Plan(backend="deepspeed", script="train.py", nproc=2, nnodes=2, node_rank=1,
                                   master_addr="10.0.0.1"), environ={})
    assert two.argv[0] == "torchrun" and two.env["UNIFIED_DIST_BACKEND"] == "deepspeed"


def test_the_engines_optimizer_reads_through_and_refuses_a_new_group():
    """A scheduler drives the user's optimizer through the wrapper; a group added after ud.prepare would never be
    stepped by the engine (it partitioned the groups it was given): one line, and the optimizer keeps its groups."""
    import torch

    from unified_dist.backends.deepspeed_backend import EngineOptimizer
    from unified_dist.errors import UnifiedDistError

    weight = torch.nn.Parameter(torch.zeros(2))
    inner = torch.optim.SGD([weight], lr=0.5)
    wrapped = EngineOptimizer(engine=None, optimizer=inner)
    scheduler = torch.optim.lr_scheduler.StepLR(wrapped, step_size=1, gamma=0.1)
    scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05) and wrapped.state is inner.state
    with pytest.raises(UnifiedDistError) as info:
        wrapped.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    assert "before ud.prepare" in str(info.value) and "\n" not in str(info.value)
    assert len(inner.param_groups) == 1 and repr(wrapped).startswith("EngineOptimizer(SGD")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_only_per_rank_shards_that_would_miss_deepspeeds_partitions_are_refused(stage):
    """ud.save/ud.load take the portable format under every stage; save_sharded (torch's DCP over the module) is
    refused under ZeRO-3 (each rank holds a slice of every parameter), load_sharded under ZeRO 1-3 (it would miss
    the float32 master weights), each in one line naming ud.save/ud.load."""
    from types import SimpleNamespace

    from unified_dist.backends.deepspeed_backend import DeepSpeedBackend

    backend = SimpleNamespace(zero_stage=stage)
    problems = {action: DeepSpeedBackend.checkpoint_problem(backend, action)
                for action in ("save", "load", "save_sharded", "load_sharded")}
    refused = {action for action, problem in problems.items() if problem is not None}
    assert refused == {0: set(), 1: {"load_sharded"}, 2: {"load_sharded"}, 3: {"save_sharded", "load_sharded"}}[stage]
    for action in refused:
        assert "\n" not in problems[action] and f"ud.{action.split('_')[0]}(" in problems[action]
