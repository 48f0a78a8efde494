"""``unified_dist.accelerate`` in one process (issue #41): the tracker calls go through
:mod:`unified_dist.trackers`, a lonely Accelerate state is refused, every other name is Accelerate's
own, and ``python -m unified_dist.accelerate`` swaps the class. The launches:
tests/launchers/test_accelerate_compat.py."""
from __future__ import annotations

import os
import sys
import types

import pytest


@pytest.fixture
def fresh_accelerate():
    """Accelerate's process-wide state empty before and after the test."""
    from accelerate.state import AcceleratorState, GradientState

    def reset():
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    reset()
    yield
    reset()


class FakeTrackers(types.ModuleType):
    """Stands for unified_dist.trackers (issue #41, item 3): records the calls."""

    def __init__(self):
        super().__init__("unified_dist.trackers")
        self.calls: list = []

    def start(self, log_with, project_dir=None, project_name="", config=None, init_kwargs=None):
        self.calls.append(("start", log_with, project_dir, project_name, config, init_kwargs))

    def log(self, values, step=None):
        self.calls.append(("log", values, step))

    def get(self, name):
        return types.SimpleNamespace(name=name, tracker=f"run of {name}")

    def finish(self):
        self.calls.append(("finish",))


def test_trackers_go_through_unified_dist_trackers(fresh_accelerate, monkeypatch, tmp_path):
    import unified_dist
    from unified_dist.accelerate import Accelerator

    fake = FakeTrackers()
    monkeypatch.setitem(sys.modules, "unified_dist.trackers", fake)
    monkeypatch.setattr(unified_dist, "trackers", fake, raising=False)
    accelerator = Accelerator(log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("demo", config={"lr": 0.1})
    accelerator.log({"loss": 0.5}, step=3)
    assert accelerator.get_tracker("tensorboard").name == "tensorboard"
    assert accelerator.get_tracker("tensorboard", unwrap=True) == "run of tensorboard"
    accelerator.end_training()
    assert fake.calls == [("start", "tensorboard", str(tmp_path), "demo", {"lr": 0.1}, {}),
                          ("log", {"loss": 0.5}, 3), ("finish",)]


def test_without_log_with_the_tracker_calls_do_nothing_and_need_no_tracker_module(fresh_accelerate, monkeypatch):
    from unified_dist.accelerate import Accelerator

    monkeypatch.setitem(sys.modules, "unified_dist.trackers", None)  # importing it would fail
    accelerator = Accelerator()
    accelerator.init_trackers("demo")
    accelerator.log({"loss": 1.0})
    accelerator.end_training()
    with pytest.raises(Exception, match="init_trackers"):
        accelerator.get_tracker("tensorboard")


def test_one_plain_process_is_accelerates_world_of_one(fresh_accelerate):
    import accelerate

    from unified_dist.accelerate import Accelerator

    accelerator = Accelerator()
    assert isinstance(accelerator, accelerate.Accelerator)
    assert (accelerator.num_processes, accelerator.distributed_type) == (1, accelerate.DistributedType.NO)


def test_join_uneven_inputs_enters_torchs_join_over_cpu_processes_as_over_gpus(fresh_accelerate, monkeypatch):
    """Issue #58, item 10: Accelerate's ``join_uneven_inputs`` does nothing on ``MULTI_CPU`` but warn; unified_dist's
    enters torch's ``Join`` there, with Accelerate's arguments (``enable`` when batches are uneven), and leaves
    ``multi_device`` Accelerate's answer outside that moment. ``Join`` is recorded here; the real one over gloo:
    tests/launchers/test_accelerate_own_scripts.py (``test_can_join_uneven_inputs``, 2 batches against 1)."""
    import accelerate
    import accelerate.accelerator
    import torch

    from unified_dist.accelerate import Accelerator

    entered = []

    class RecordedJoin:
        def __init__(self, joinables, enable, throw_on_early_termination):
            entered.append((joinables, enable, throw_on_early_termination))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(accelerate.accelerator, "Join", RecordedJoin)
    accelerator = Accelerator()
    model = torch.nn.Linear(1, 1)
    with accelerator.join_uneven_inputs([model]):  # one process (DistributedType.NO): Accelerate's nothing
        pass
    assert entered == []
    accelerator.state.distributed_type = accelerate.DistributedType.MULTI_CPU  # as the launch gives
    with accelerator.join_uneven_inputs([model], even_batches=False):
        assert accelerator.multi_device is False
    with accelerator.join_uneven_inputs([model], even_batches=True):
        pass
    assert entered == [([model], True, False), ([model], False, False)]
    assert accelerator.multi_device is False


def test_a_state_made_alone_before_the_accelerator_is_refused(fresh_accelerate, monkeypatch):
    from accelerate.state import PartialState

    from unified_dist.accelerate import Accelerator
    from unified_dist.errors import LaunchError

    for key, value in dict(HOROVOD_RANK="0", HOROVOD_SIZE="2", HOROVOD_LOCAL_RANK="0", HOROVOD_LOCAL_SIZE="2",
                           HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1", HOROVOD_GLOO_RENDEZVOUS_PORT="1").items():
        monkeypatch.setenv(key, value)
    PartialState()  # horovodrun's variables are not Accelerate's: this state runs alone
    with pytest.raises(LaunchError, match="before any PartialState"):
        Accelerator()


def test_other_names_are_accelerates_own():
    import accelerate
    import accelerate.logging
    import accelerate.utils

    import unified_dist.accelerate as uda
    import unified_dist.accelerate.logging as uda_logging
    import unified_dist.accelerate.utils as uda_utils

    assert uda.DistributedType is accelerate.DistributedType
    assert uda_utils.set_seed is accelerate.utils.set_seed
    assert uda_utils.DataLoaderConfiguration is accelerate.utils.DataLoaderConfiguration
    assert uda_logging.get_logger is accelerate.logging.get_logger
    assert issubclass(uda.Accelerator, accelerate.Accelerator)


@pytest.fixture
def run_probe(tmp_path, monkeypatch):
    """Runs a probe script through ``python -m unified_dist.accelerate``'s ``main`` in this process and gives
    what it put in ``sys.modules['__probe__']``; Accelerate's names the runner replaces, ``sys.argv`` and
    ``sys.path`` are restored after the test."""
    import accelerate
    import accelerate.accelerator
    import accelerate.state

    from unified_dist.accelerate.__main__ import main

    for module, name in ((accelerate, "Accelerator"), (accelerate, "PartialState"),
                         (accelerate.accelerator, "Accelerator"), (accelerate.state, "PartialState")):
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "__probe__", raising=False)

    def run(text: str):
        script = tmp_path / "probe.py"
        script.write_text(text)
        main([str(script)])
        return sys.modules["__probe__"]

    return run


def test_the_runner_without_a_script_says_how_to_call_it():
    from unified_dist.accelerate.__main__ import main

    with pytest.raises(SystemExit, match="usage: python -m unified_dist.accelerate script.py"):
        main([])


def test_the_runner_makes_accelerates_names_the_joined_ones(run_probe, tmp_path):
    """``from accelerate import Accelerator, PartialState``, ``from accelerate.accelerator import
    Accelerator`` (Accelerate's own test scripts import it so) and ``from accelerate.state import PartialState``
    (transformers' ``TrainingArguments``) read unified_dist's classes."""
    from unified_dist.accelerate import Accelerator, PartialState

    probed = run_probe("import sys\nfrom accelerate import Accelerator, PartialState\n"
                       "from accelerate.accelerator import Accelerator as FromTheModule\n"
                       "from accelerate.state import PartialState as StateFromTheModule\n"
                       "sys.modules['__probe__'] = (Accelerator, PartialState, FromTheModule, StateFromTheModule)\n")
    assert probed == (Accelerator, PartialState, Accelerator, PartialState)
    assert str(tmp_path) == sys.path[0]


def test_the_first_partial_state_joins_the_launchers_world_over_gloo_on_a_cpu(fresh_accelerate, monkeypatch):
    """Accelerate's ``PartialState()`` runs each of several processes alone on a machine without CUDA;
    unified_dist's joins first and asks for ``cpu=True`` (here the join is stubbed to a world of 2, and
    Accelerate's constructor records what it is given)."""
    import accelerate

    from unified_dist.accelerate import accelerator

    given, joined = [], []
    monkeypatch.setattr(accelerator.world, "join", lambda timeout=None: joined.append(timeout) or 2)
    monkeypatch.setattr(accelerator.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(accelerate.PartialState, "__init__", lambda self, cpu=False, **kw: given.append(cpu))
    accelerator.PartialState()
    assert joined == [None] and given == [True]


def test_ud_calls_after_the_accelerator_keep_its_accumulation(fresh_accelerate):
    """A ``ud`` call adopts the Accelerator's group; the backend's own Accelerator must not reset the
    user's gradient accumulation (Accelerate keeps one per process), and asking ud for another is refused."""
    import unified_dist as ud
    from unified_dist.accelerate import Accelerator
    from unified_dist.errors import UnifiedDistError

    accelerator = Accelerator(gradient_accumulation_steps=2)
    try:
        assert ud.gradient_accumulation_steps() == 2
        assert accelerator.gradient_accumulation_steps == 2
    finally:
        ud.shutdown()
    with pytest.raises(UnifiedDistError, match="gradient_accumulation_steps=2 already runs"):
        ud.init(gradient_accumulation_steps=3)


def test_a_ud_session_over_the_accelerator_leaves_its_accumulation_plugin_as_it_was(fresh_accelerate):
    from accelerate.utils import GradientAccumulationPlugin

    import unified_dist as ud
    from unified_dist.accelerate import Accelerator

    plugin = GradientAccumulationPlugin(num_steps=2, adjust_scheduler=False)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin)
    try:
        assert ud.world_size() == 1
        assert accelerator.gradient_state.plugin_kwargs == plugin.to_kwargs()
    finally:
        ud.shutdown()
    assert accelerator.gradient_state.plugin_kwargs == plugin.to_kwargs()


def test_leaving_frees_every_accelerators_ddp_reducers_before_the_group_goes(tmp_path):
    """A DDP reducer keeps its process group alive past ``destroy_process_group``; left to interpreter
    exit, gloo's threads aborted one torchrun job in three (SIGABRT, 3 of 8 on 2026-11-26; 0 of 16 with
    this). ``_leave(False)`` (``end_training``) frees the reducers of every live Accelerator's models;
    ``_leave(True)`` (the exit handler) also destroys the group."""
    import torch
    import torch.distributed as dist

    from unified_dist.accelerate import accelerator

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        plain = torch.nn.Linear(2, 2)
        holder = type("Holder", (), {"_models": [ddp, plain]})()  # stands for an Accelerator (weakly held)
        accelerator._LIVE.add(holder)
        accelerator._leave(False)
        assert not hasattr(ddp, "reducer") and dist.is_initialized()
        accelerator._leave(True)
        assert not dist.is_initialized()
    finally:
        accelerator._LIVE.discard(holder)
        if dist.is_initialized():
            dist.destroy_process_group()


def test_end_training_frees_the_reducers_first(fresh_accelerate, monkeypatch):
    from unified_dist.accelerate import accelerator

    calls = []
    monkeypatch.setattr(accelerator, "_leave", lambda destroy: calls.append(destroy))
    accelerator.Accelerator(cpu=True).end_training()
    assert calls == [False]


@pytest.fixture
def restored_environ():
    """``os.environ`` as it was, after the test (Accelerate's state writes ``RANK``, ``MASTER_PORT``...)."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


LAUNCHER_ENVIRONMENTS = {
    "mpirun": {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
    "srun": {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
             "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODELIST": "localhost", "SLURM_STEP_NODELIST": "localhost",
             "SLURM_NTASKS_PER_NODE": "2"},
    "horovodrun": {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
                   "HOROVOD_CONTROLLER": "gloo"},
}
TORCH_WORLD = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
PROBE = ("import os, sys\nimport accelerate.state\n"
         f"seen = {{k: os.environ.get(k) for k in {TORCH_WORLD!r}}}\n"
         "sys.modules['__probe__'] = (seen, accelerate.state.PartialState)\n")


def without_launchers(*names: str) -> None:
    """Remove every launcher's variables (and ``names``) from ``os.environ`` (``restored_environ`` puts them back)."""
    for key in [k for k in os.environ if k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_", "MV2_")) or k in names]:
        del os.environ[key]


@pytest.mark.parametrize("launcher", sorted(LAUNCHER_ENVIRONMENTS))
def test_the_runner_exports_the_launchers_world_before_the_script_runs(
        launcher, fresh_accelerate, restored_environ, run_probe):
    """Issue #51: under a launcher whose variables torch and Accelerate do not read, the script's first line
    already sees torch's variables for the launcher's world (transformers' ``TrainingArguments`` builds
    ``accelerate.state.PartialState`` from them; many scripts read ``WORLD_SIZE``/``LOCAL_RANK`` themselves),
    and ``accelerate.state.PartialState`` is the class that joins it on a machine without CUDA. The processes
    here carry the launcher's variables without the launcher (nothing connects). Real launches:
    tests/launchers/test_trainer_family.py."""
    from unified_dist.accelerate import PartialState

    without_launchers(*TORCH_WORLD, "TORCHELASTIC_RUN_ID")
    os.environ.update(LAUNCHER_ENVIRONMENTS[launcher])
    seen, state_class = run_probe(PROBE)
    assert state_class is PartialState
    assert {k: seen[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert seen["MASTER_ADDR"] == "127.0.0.1" and seen["MASTER_PORT"].isdigit()


def test_the_runner_changes_nothing_where_torchrun_exported_the_world(fresh_accelerate, restored_environ, run_probe):
    """Under torchrun (and ``accelerate launch``) the variables are the launcher's own: the runner keeps them."""
    without_launchers()
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29999"}
    os.environ.update(torchrun)
    assert run_probe(PROBE)[0] == {k: torchrun[k] for k in TORCH_WORLD}
