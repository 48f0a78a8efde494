"""Replica groups (issue #53) without a launch: the variables, what is refused in one line, the launcher's
commands and its supervision of the groups, and a prepared loader that jumps to a peer's position mid-pass.
The launches with kills and hangs are tests/launchers/test_replica_groups.py."""
import sys

import pytest
import torch

from unified_dist.backends.base import Config
from unified_dist.backends.replica_groups import layout_from, refuse_layout, refuse_objects
from unified_dist.cli import replicas
from unified_dist.cli.launch import Command
from unified_dist.data.loaders import LoaderStack, PreparedDataLoader
from unified_dist.errors import LaunchError
from unified_dist.parallel.sharding import Sharding

LIGHTHOUSE = {"TORCHFT_LIGHTHOUSE": "http://localhost:29510", "REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "3"}


def test_the_layout_comes_from_the_three_variables():
    assert layout_from({}) is None
    layout = layout_from({**LIGHTHOUSE, "REPLICA_GROUP_RESTARTS": "2"})
    assert (layout.group, layout.groups, layout.lighthouse, layout.restarts) == (1, 3, "http://localhost:29510", 2)


@pytest.mark.parametrize("change, words", [({"REPLICA_GROUP_ID": ""}, "are not both whole numbers"),
                                           ({"NUM_REPLICA_GROUPS": "two"}, "are not both whole numbers"),
                                           ({"REPLICA_GROUP_ID": "3"}, "outside 0..2")])
def test_a_half_set_layout_is_refused_in_one_line(change, words):
    with pytest.raises(LaunchError, match=words) as caught:
        layout_from({**LIGHTHOUSE, **change})
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("config, backend, words", [
    (Config(), "accelerate", "run on the torch backend"),
    (Config(), "horovod", "run on the torch backend"),
    (Config(sharding=Sharding("no", tp=2)), "torch", "tp=2 (tensor parallelism) is not supported"),
    (Config(mixed_precision="fp16"), "torch", "mixed_precision='fp16'"),
    (Config(gradient_compression="fp16"), "torch", "gradient_compression='fp16'"),
    (Config(sync_batchnorm=True), "torch", "sync_batchnorm=True"),
])
def test_what_torchft_cannot_make_fault_tolerant_is_refused_at_init(config, backend, words):
    line = refuse_layout(LIGHTHOUSE, config, backend, "some launcher")
    assert words in line and "\n" not in line


def test_ddp_fsdp_and_bf16_inside_a_group_are_accepted_and_nothing_is_asked_without_a_lighthouse():
    for config in (Config(), Config(sharding=Sharding("fsdp")), Config(mixed_precision="bf16")):
        assert refuse_layout(LIGHTHOUSE, config, "torch", "torchrun") is None
    assert refuse_layout({}, Config(mixed_precision="fp16"), "horovod", "horovodrun") is None


def test_two_optimizers_and_a_stream_are_refused_at_prepare():
    model = torch.nn.Linear(2, 2)
    two = refuse_objects([torch.optim.SGD(model.parameters(), lr=0.1)], optimizers_so_far=1)
    assert "prepares 2 optimizers" in two

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    assert "a prepared stream" in refuse_objects([torch.utils.data.DataLoader(Stream())], 0)
    assert refuse_objects([model, torch.optim.SGD(model.parameters(), lr=0.1)], 0) is None


def loader(world=(0, 1)):
    data = torch.utils.data.TensorDataset(torch.arange(24.0))
    return PreparedDataLoader(torch.utils.data.DataLoader(data, batch_size=2, shuffle=True), lambda: world,
                              torch.device("cpu"), 0, LoaderStack())


def test_jump_to_continues_the_open_iteration_at_the_given_position():
    peer, mine = loader(), loader()
    it = iter(peer)
    for _ in range(4):
        next(it)
    state = peer.state_dict()
    rest = [b.tolist() for (b,) in it]
    jumped = {"done": False}

    def heal():
        if not jumped["done"]:
            jumped["done"] = True
            mine.jump_to(state)

    got = []
    for i, (batch,) in enumerate(mine):
        got.append(batch.tolist())
        if i == 0:
            mine._stack.before_batch = heal
    assert got[1:] == rest  # after the first batch, the peer's remaining batches of the epoch, then the pass ends
    assert mine.state_dict()["epoch"] == peer.state_dict()["epoch"]


def fake_command(code: str) -> Command:
    return Command((sys.executable, "-c", code))


def test_dry_run_shows_the_lighthouse_and_one_command_per_group():
    lines = replicas.describe(Command(("torchrun", "--standalone", "--nproc_per_node", "2", "train.py")), 2)
    assert lines.splitlines()[0].startswith("torchft_lighthouse --min_replicas 1")
    assert "REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 torchrun --standalone" in lines.splitlines()[2]


def test_the_join_timeout_reaches_the_lighthouse_and_is_bounded(tmp_path, monkeypatch, capsys):
    """--replica-join-timeout S is the lighthouse's --join_timeout_ms (dry run and the launched lighthouse), 5 s
    by default; 60 s or more (a group's quorum gives up after QUORUM_TIMEOUT = 60 s) and 0 are one-line errors."""
    from unified_dist.cli.main import main

    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)

    def dry(*flags):
        code = main(["launch", "--nproc", "1", "--replica-groups", "2", "--dry-run", *flags, "train.py"])
        return code, capsys.readouterr()

    (code, default), (code_set, set_) = dry(), dry("--replica-join-timeout", "12.5")
    assert code == code_set == 0, default.err + set_.err
    assert "--join_timeout_ms 5000 " in default.out.splitlines()[0]
    assert "--join_timeout_ms 12500 " in set_.out.splitlines()[0]
    assert replicas.lighthouse_command(0, 12500)[-3:-2] == ["12500"]  # what the launcher starts
    assert replicas.Lighthouse(tmp_path / "log", 12500).join_ms == 12500
    for bad in ("60", "0"):
        code, refused = dry("--replica-join-timeout", bad)
        assert code == 2 and refused.err.count("\n") == 1, refused.err
        assert f"--replica-join-timeout {bad}: give seconds above 0 and below 60" in refused.err


def supervise(members, max_restarts):
    for member in members:
        member.start()
    try:
        return replicas._watch(members, max_restarts, {"signal": 0})
    finally:
        for member in members:
            member.kill()


def test_a_failed_group_is_started_again_while_another_runs_and_the_job_ends_well(tmp_path):
    marker = tmp_path / "failed-once"
    flaky = fake_command(f"import os, pathlib, sys, time; p = pathlib.Path({str(marker)!r});\n"
                         "if not p.exists(): p.touch(); sys.exit(3)\n"
                         "assert os.environ['REPLICA_GROUP_RESTARTS'] == '1'")
    steady = fake_command("import time; time.sleep(2)")
    members = [replicas.Group(0, steady, replicas.group_env(steady, 0, 2, "http://x")),
               replicas.Group(1, flaky, replicas.group_env(flaky, 1, 2, "http://x"))]
    assert supervise(members, 3) == 0
    assert members[1].exit_codes == [3, 0] and members[0].exit_codes == [0]


def test_a_group_that_keeps_failing_stops_the_job_with_its_exit_status():
    failing, steady = fake_command("raise SystemExit(5)"), fake_command("import time; time.sleep(30)")
    members = [replicas.Group(0, steady, {}), replicas.Group(1, failing, {})]
    assert supervise(members, 2) == 5
    assert members[1].exit_codes == [5, 5, 5]


def test_no_group_is_started_again_when_none_is_left_to_heal_from():
    members = [replicas.Group(0, fake_command("raise SystemExit(4)"), {})]
    assert supervise(members, 3) == 1
    assert members[0].exit_codes == [4]


def test_gather_for_metrics_inside_a_prepared_loader_is_refused_across_groups():
    """Each group holds only its share of a prepared loader, and the collectives span one group: the gathered
    metric would silently cover a fraction of the data."""
    from types import SimpleNamespace

    from unified_dist.errors import UnifiedDistError
    from unified_dist.session import Session

    stack = LoaderStack()
    backend = SimpleNamespace(replicas=SimpleNamespace(layout=SimpleNamespace(groups=2)))
    session = Session(backend, None, None, stack)
    stack.push(object())
    with pytest.raises(UnifiedDistError, match="would gather one group's share of the data only") as caught:
        session.gather_for_metrics(torch.zeros(2))
    assert "\n" not in str(caught.value)


def test_a_restarted_group_takes_every_prepared_object_and_the_generators_from_the_peer():
    """What the live peer sends (Session._replica_state) and the restarted group loads (_load_replica_state)."""
    import random

    from unified_dist.session import Session

    def prepared():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        return model, loader()

    peer_model, peer_loader = prepared()
    peer = Session(None, None, None, LoaderStack(), healable=[peer_model, peer_loader])
    with torch.no_grad():
        peer_model.weight.add_(1.0)
    it = iter(peer_loader)
    next(it), next(it)
    torch.manual_seed(5)
    random.seed(5)
    state = peer._replica_state()
    expected_draws = (torch.rand(3).tolist(), random.random())

    mine_model, mine_loader = prepared()
    mine = Session(None, None, None, LoaderStack(), healable=[mine_model, mine_loader])
    torch.manual_seed(9)
    mine._load_replica_state(state)
    assert torch.equal(mine_model.weight, peer_model.weight)
    assert mine_loader.state_dict() == peer_loader.state_dict()
    assert (torch.rand(3).tolist(), random.random()) == expected_draws
    with pytest.raises(Exception, match="every replica group must run the same script"):
        Session(None, None, None, LoaderStack(), healable=[mine_model])._load_replica_state(state)


def test_each_group_gets_its_own_gpus_where_there_are_enough():
    command = Command(("torchrun", "train.py"))
    gpus = replicas.visible_gpus(8, {})
    assert [replicas.group_env(command, i, 2, "http://x", {}, gpus, 4)["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == \
        ["0,1,2,3", "4,5,6,7"]
    shown = replicas.visible_gpus(8, {"CUDA_VISIBLE_DEVICES": "3,5"})
    assert [replicas.group_env(command, i, 2, "http://x", {}, shown, 1)["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == \
        ["3", "5"]
    assert "CUDA_VISIBLE_DEVICES" not in replicas.group_env(command, 1, 2, "http://x", {}, gpus[:3], 2)


def test_a_step_whose_batch_came_from_no_prepared_loader_is_refused_at_backward():
    """The quorum (and a copy into this group) must come before the forward; after it, the copy would replace
    the weights the graph was built on."""
    from types import SimpleNamespace

    from unified_dist.backends.torch_ddp import TorchBackend
    from unified_dist.errors import UnifiedDistError

    fake = SimpleNamespace(replicas=SimpleNamespace(opened=False))
    with pytest.raises(UnifiedDistError, match="must come from a DataLoader given to ud.prepare") as caught:
        TorchBackend.backward(fake, torch.zeros(()))
    assert "\n" not in str(caught.value)


def test_only_the_training_loader_holds_a_quorum_once_known():
    from types import SimpleNamespace

    from unified_dist.session import Session

    opened = []
    stack = LoaderStack()
    backend = SimpleNamespace(replicas=SimpleNamespace(begin_step=lambda: opened.append(stack.current)))
    session = Session(backend, None, None, stack)
    train, evaluation = object(), object()
    stack.push(evaluation)
    session.begin_replica_step()  # before any ud.backward: any loader's fetch holds the quorum
    stack.remove(evaluation)
    session._training_loader = train
    stack.push(evaluation)
    session.begin_replica_step()  # an evaluation pass between steps holds none
    stack.remove(evaluation)
    stack.push(train)
    session.begin_replica_step()
    assert opened == [evaluation, train]


def test_ten_steps_in_a_row_that_do_not_commit_stop_the_group_in_one_line():
    from types import SimpleNamespace

    from unified_dist.backends.replica_groups import MAX_UNCOMMITTED, ReplicaGroups, ReplicaLayout
    from unified_dist.errors import UnifiedDistError

    manager = SimpleNamespace(should_commit=lambda: False, current_step=lambda: 3, errored=lambda: "gloo: sizes")
    fake = SimpleNamespace(layout=ReplicaLayout(0, 2, "http://x"), manager=manager, _open=True, _uncommitted=0,
                           _watchdog=SimpleNamespace(disarm=lambda: None), begin_step=lambda: None, participants=2,
                           short_steps=[], _last_participants=2, rank=1)
    for _ in range(MAX_UNCOMMITTED - 1):
        assert ReplicaGroups.commit(fake) is False
    with pytest.raises(UnifiedDistError, match=f"{MAX_UNCOMMITTED} steps in a row did not commit") as caught:
        ReplicaGroups.commit(fake)
    assert "\n" not in str(caught.value)


def test_a_per_epoch_scheduler_still_steps_after_an_epoch_whose_last_step_was_dropped():
    from types import SimpleNamespace

    from unified_dist.training.accumulation import PreparedScheduler

    calls = []
    sync = SimpleNamespace(optimizer_steps=0, sync_gradients=True, committed=True)
    scheduler = PreparedScheduler(SimpleNamespace(step=lambda: calls.append(sync.optimizer_steps)), sync)
    sync.optimizer_steps, sync.committed = 5, False  # 5 steps committed in the epoch, its last one dropped
    scheduler.step()
    sync.committed = False  # a per-step scheduler after another dropped step: nothing committed since
    scheduler.step()
    sync.optimizer_steps, sync.committed = 6, True
    scheduler.step()
    assert calls == [5, 6]
