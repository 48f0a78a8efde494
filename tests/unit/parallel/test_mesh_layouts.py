"""The layout settings of issue 26 without a launch: how dp_replicate, tp and tp_plan read, the
one-line errors of a layout that cannot run, and where each rank sits on the mesh (arithmetic from
the documented row-major order, not from the code). The layouts themselves run under real launchers
in tests/launchers/test_mesh_under_launchers.py."""
from __future__ import annotations

import pytest

from unified_dist.errors import LaunchError, SettingError, UnifiedDistError
from unified_dist.parallel.mesh import Layout, accelerate_dp_shard
from unified_dist.parallel.sharding import Sharding
from unified_dist.session import config_from


def test_dp_shard_is_the_rest_of_the_world():
    assert Layout.plan(8, 2, 2) == Layout(2, 2, 2)
    assert Layout.plan(4, 1, 4) == Layout(1, 1, 4)
    assert Layout.plan(4, "nodes", 1, machines=lambda: 2) == Layout(2, 2, 1)


def test_rank_positions_follow_the_documented_row_major_order():
    """docs/parallelism.md: rank r sits at (r // (S*T), r // T % S, r % T); data-parallel rank r // T."""
    layout = Layout(2, 2, 2)
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [layout.tp_rank(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert layout.data_parallel == 4 and layout.world == 8


@pytest.mark.parametrize("world,replicate,tp,words", [
    (4, 3, 1, "dp_replicate=3 x tp=1 does not divide the world of 4 ranks"),
    (6, 2, 2, "dp_replicate=2 x tp=2 does not divide the world of 6 ranks"),
    (1, 1, 2, "does not divide the world of 1 ranks"),
])
def test_a_layout_that_does_not_divide_the_world_is_one_line(world, replicate, tp, words):
    with pytest.raises(LaunchError) as info:
        Layout.plan(world, replicate, tp)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_accelerates_declared_shard_size_must_fit_the_world():
    with pytest.raises(LaunchError, match="give --parallelism_config_dp_shard_size 2"):
        Layout.plan(4, 2, 1, dp_shard=1)
    assert Layout.plan(4, 2, 1, dp_shard=2) == Layout(2, 2, 1)


def test_accelerates_parallelism_flags_are_read_and_what_we_lack_is_refused():
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
           "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "1",
           "PARALLELISM_CONFIG_CP_SIZE": "1", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    config = config_from({}, env, cuda=False)
    assert (config.sharding.mode, config.sharding.dp_replicate, config.sharding.tp, config.sharding.dp_shard) == \
        ("fsdp", 2, 1, 2)
    assert accelerate_dp_shard({"PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"}) is None  # without the switch: unsaid
    with pytest.raises(LaunchError, match="no context parallelism"):
        accelerate_dp_shard({**env, "PARALLELISM_CONFIG_CP_SIZE": "2"})
    with pytest.raises(LaunchError, match="contradicts"):
        config_from({"dp_replicate": 1, "tp": 2}, {**env, "PARALLELISM_CONFIG_TP_SIZE": "4"}, cuda=False)


def test_launcher_words_for_offload_and_checkpointing():
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true",
           "FSDP_ACTIVATION_CHECKPOINTING": "true"}
    sharding = config_from({}, env, cuda=False).sharding
    assert (sharding.cpu_offload, sharding.activation_checkpointing) == (True, True)
    quiet = config_from({}, {**env, "FSDP_OFFLOAD_PARAMS": "false", "FSDP_ACTIVATION_CHECKPOINTING": "false"},
                        cuda=False).sharding
    assert (quiet.cpu_offload, quiet.activation_checkpointing) == (False, False)


@pytest.mark.parametrize("given,words", [
    ({"dp_replicate": 2}, "dp_replicate=2 applies to the blocks FSDP2 shards; add sharding='fsdp'"),
    ({"cpu_offload": True}, "cpu_offload=True applies to the blocks FSDP2 shards; add sharding='fsdp' "
                            "(UNIFIED_DIST_SHARDING=fsdp, accelerate launch --use_fsdp --fsdp_version 2); under the "
                            "deepspeed backend, offload_optimizer='cpu'"),
    ({"activation_checkpointing": True}, "activation_checkpointing=True applies"),
    ({"tp": 2, "gradient_compression": "bf16"}, "use one of the two"),
])
def test_settings_that_need_fsdp_say_so_in_one_line(given, words):
    with pytest.raises(UnifiedDistError) as info:
        config_from(given, {}, cuda=False)
    assert words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("variable,text,value", [
    ("UNIFIED_DIST_DP_REPLICATE", "nodes", "nodes"), ("UNIFIED_DIST_DP_REPLICATE", "2", 2),
    ("UNIFIED_DIST_TP", "4", 4), ("UNIFIED_DIST_TP_PLAN", "auto", "auto"),
    ("UNIFIED_DIST_TP_PLAN", '{"blocks.*.w1": "colwise"}', {"blocks.*.w1": "colwise"}),
])
def test_the_variables_read(variable, text, value):
    name = {"UNIFIED_DIST_DP_REPLICATE": "dp_replicate", "UNIFIED_DIST_TP": "tp",
            "UNIFIED_DIST_TP_PLAN": "tp_plan"}[variable]
    env = {variable: text, "UNIFIED_DIST_SHARDING": "fsdp"}
    assert getattr(config_from({}, env, cuda=False).sharding, name) == value


@pytest.mark.parametrize("variable,text", [("UNIFIED_DIST_DP_REPLICATE", "0"), ("UNIFIED_DIST_DP_REPLICATE", "two"),
                                           ("UNIFIED_DIST_TP", "1.5"), ("UNIFIED_DIST_TP_PLAN", "[1, 2]")])
def test_bad_variables_are_one_line_setting_errors(variable, text):
    with pytest.raises(SettingError) as info:
        config_from({}, {variable: text, "UNIFIED_DIST_SHARDING": "fsdp"}, cuda=False)
    assert variable in str(info.value) and "\n" not in str(info.value)


def test_tensor_parallel_with_data_parallel_ranks_needs_fsdp():
    from unified_dist.backends.fsdp import FsdpModels

    with pytest.raises(LaunchError) as info:
        FsdpModels(Sharding(tp=2), "no", world_size=4)  # refused before any mesh is built
    assert "leaves 2 data-parallel ranks" in str(info.value) and "add sharding='fsdp'" in str(info.value)


def test_tp_and_hsdp_under_horovod_are_one_line_errors_before_horovod_starts(monkeypatch):
    import unified_dist as ud
    from unified_dist.backends.horovod_backend import HorovodBackend

    def must_not_start(*args, **kwargs):
        raise AssertionError("the Horovod backend started before the layout was refused")

    monkeypatch.setattr(HorovodBackend, "__init__", must_not_start)
    for name in ("UNIFIED_DIST_SHARDING", "UNIFIED_DIST_TP", "UNIFIED_DIST_DP_REPLICATE"):
        monkeypatch.delenv(name, raising=False)
    ud.shutdown()
    with pytest.raises(UnifiedDistError) as info:
        ud.init("horovod", tp=2)
    message = str(info.value)
    assert message.startswith("tp=2 needs torch.distributed") and "torchrun, accelerate launch, srun or mpirun" \
        in message and "\n" not in message
    with pytest.raises(UnifiedDistError, match="sharding='fsdp' needs torch.distributed"):
        ud.init("horovod", sharding="fsdp", dp_replicate=2)


def test_one_process_refuses_a_layout_of_several_ranks():
    import unified_dist as ud

    ud.shutdown()
    with pytest.raises(LaunchError, match="does not divide the world of 1 ranks"):
        ud.init("single", sharding="fsdp", dp_replicate=2)
    ud.shutdown()
    ud.init("single", sharding="fsdp", dp_replicate="nodes")  # one machine: one replica of one rank
    try:
        assert ud.device_mesh() is None and (ud.data_parallel_rank(), ud.data_parallel_world_size()) == (0, 1)
    finally:
        ud.shutdown()


def test_launch_flags_hand_the_layout_to_the_script():
    from unified_dist import settings

    env = settings.flag_environment({"dp_replicate": "nodes", "tp": 2, "tp_plan": {"a.*": "colwise"},
                                     "cpu_offload": True, "activation_checkpointing": False})
    assert env == {"UNIFIED_DIST_DP_REPLICATE": "nodes", "UNIFIED_DIST_TP": "2",
                   "UNIFIED_DIST_TP_PLAN": '{"a.*": "colwise"}', "UNIFIED_DIST_CPU_OFFLOAD": "1",
                   "UNIFIED_DIST_ACTIVATION_CHECKPOINTING": "0"}


def test_nodes_counts_the_machines_and_needs_equal_ones():
    from unified_dist.parallel.mesh import machines

    assert machines(["h1", "h1", "h2", "h2"]) == 2 and machines(["h"] * 4) == 1
    with pytest.raises(UnifiedDistError, match="needs the same number of ranks on every machine"):
        machines(["h1", "h1", "h1", "h2"])
