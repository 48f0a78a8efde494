"""Replica groups' steps without a launch (issue #58): the step watchdog's budget, a restarted group that must
hold the job's state before it commits, the job's first step that waits for every group, the buffers averaged
inside the step, and evaluation passes sharded over a group's own ranks. The launches are
tests/launchers/test_replica_groups_steps.py."""
import time
from types import SimpleNamespace

import pytest
import torch

from unified_dist.backends import replica_groups
from unified_dist.backends.replica_groups import ReplicaGroups, ReplicaLayout, StepWatchdog, first_start, replica_id
from unified_dist.data.loaders import LoaderStack, PreparedDataLoader
from unified_dist.errors import UnifiedDistError
from unified_dist.session import Session


# ---------------------------------------------------------------------------------------------- the watchdog
def test_the_watchdog_times_a_step_from_its_quorum_to_its_commit():
    watchdog = StepWatchdog(0.05, leave=lambda: None)
    assert not watchdog.overdue()  # nothing timed before the first quorum
    watchdog.arm()
    time.sleep(0.08)
    assert watchdog.overdue()
    watchdog.disarm()  # the commit
    time.sleep(0.08)
    assert not watchdog.overdue()  # between steps (an evaluation, a save) nothing is timed


def test_waiting_for_the_other_groups_is_not_the_steps_own_time():
    """Issue #58: a healthy group whose all-reduce waits for a peer that is still healing (torchft's own timeout
    bounds that wait) must not leave first: the wait is paused out of the step's budget."""
    watchdog = StepWatchdog(0.2, leave=lambda: None)
    watchdog.arm()
    with watchdog.paused():
        time.sleep(0.3)  # longer than the step's whole budget
        assert not watchdog.overdue()
    assert not watchdog.overdue()  # the step's own time left is what it was before the wait
    time.sleep(0.25)
    assert watchdog.overdue()  # its own work is still timed


def test_after_shutdown_nothing_is_timed_and_the_watch_ends():
    left = []
    watchdog = StepWatchdog(0.05, leave=lambda: left.append(1))
    watchdog.start()
    watchdog.arm()
    watchdog.stop()  # ud.shutdown, or the interpreter's exit
    watchdog.arm()  # a late quorum arms nothing any more
    time.sleep(0.15)
    assert not watchdog.overdue() and left == []


def test_an_overdue_step_makes_the_group_leave():
    left = []
    watchdog = StepWatchdog(0.04, leave=lambda: left.append(1))
    watchdog.start()
    watchdog.arm()
    time.sleep(0.2)
    assert left == [1]


# ------------------------------------------------------------------------------ a restarted group's first step
def test_a_group_started_again_says_so_in_its_torchft_name_which_still_ends_with_its_index():
    from torchft.manager import extract_trailing_digits

    first, again = replica_id(ReplicaLayout(3, 4, "http://x")), replica_id(ReplicaLayout(3, 4, "http://x", 2))
    assert first_start(f"{first}:uuid") and not first_start(f"{again}:uuid")
    assert extract_trailing_digits(first) == extract_trailing_digits(again) == 3  # torchft's ranks come from it


class FakeManager:
    """start_quorum answers the next of ``quorums`` (a heal at a step > 0 calls the load, as torchft does)."""

    def __init__(self, groups, quorums):
        self.groups, self.quorums, self.started = groups, list(quorums), 0

    def start_quorum(self):
        self.started += 1
        quorum = self.quorums.pop(0)
        self.groups._quorums.latest = quorum
        if quorum.max_step > 0:
            self.groups.healed_at = quorum.max_step


def restarted(quorums):
    groups = object.__new__(ReplicaGroups)
    groups.layout = ReplicaLayout(1, 2, "http://x", restarts=1)
    groups.healed_at = None
    groups._quorums = SimpleNamespace(latest=None)
    groups._may_commit = False
    groups._started = True  # a restarted group is not held to the job's start (its own rule is stricter)
    groups._open = False
    groups._watchdog = StepWatchdog(60, leave=lambda: None)
    groups.manager = FakeManager(groups, quorums)
    return groups


def quorum(step, *names):
    return SimpleNamespace(max_step=step, replica_ids=[f"{name}:uuid" for name in names])


FIRST_0, AGAIN_0, AGAIN_1 = "unified_dist_group_0", "unified_dist_restarted_group_0", "unified_dist_restarted_group_1"


def test_two_groups_started_again_that_meet_at_step_0_stop_in_one_line_rather_than_train_from_scratch():
    """Issue #58: both healed from nobody (each took the other's fresh start): neither may commit."""
    groups = restarted([quorum(0, AGAIN_0, AGAIN_1)])
    with pytest.raises(UnifiedDistError, match="found no live replica group to heal from") as caught:
        groups.begin_step()
    assert "it met only groups that were started again themselves, at step 0" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert not groups._open  # no step runs


def test_a_group_started_again_with_nobody_to_meet_stops_in_one_line():
    groups = restarted([quorum(0, AGAIN_1)])
    with pytest.raises(UnifiedDistError, match="it met no other group"):
        groups.begin_step()


def test_a_group_started_again_that_heals_from_a_live_group_trains_on():
    groups = restarted([quorum(40, FIRST_0, AGAIN_1), quorum(41, FIRST_0, AGAIN_1)])
    groups.begin_step()
    assert groups.healed_at == 40 and groups._open
    groups._open = False
    groups.begin_step()  # the next step: its quorum, nothing more to check
    assert groups.manager.started == 2 and groups._may_commit


def test_a_group_started_again_at_the_jobs_start_trains_with_a_group_on_its_first_start():
    """The job's start: the other group has committed nothing yet, so its state is the job's (nothing was lost)."""
    groups = restarted([quorum(0, FIRST_0, AGAIN_1)])
    groups.begin_step()
    assert groups.manager.started == 1 and groups._open


# ------------------------------------------------------------------------------------------- the job's start
def first(quorums, groups=2, timeout_s=60.0):
    """Group 0 of ``groups`` on its first start, as __init__ leaves it, whose quorums answer ``quorums``."""
    group = restarted(quorums)
    group.layout = ReplicaLayout(0, groups, "http://x")
    group._may_commit, group._started, group._quorum_timeout_s = True, False, timeout_s
    return group


@pytest.fixture
def no_pause(monkeypatch):
    """The pauses between tries, recorded instead of slept."""
    slept = []
    monkeypatch.setattr(replica_groups.time, "sleep", slept.append)
    return slept


def test_a_group_on_its_first_start_asks_again_until_every_group_is_in_the_jobs_first_quorum(no_pause):
    """A fresh run (772b515) saw group 0 start 2.8 s before group 1, take a quorum of one, train the whole job
    alone, and group 1 then train it again from step 0: two models, status 0."""
    group = first([quorum(0, FIRST_0), quorum(0, FIRST_0), quorum(0, FIRST_0, "unified_dist_group_1")])
    group.begin_step()
    assert group.manager.started == 3 and group._open and no_pause == [0.5, 0.5]
    group._open = False
    group.manager.quorums.append(quorum(1, FIRST_0))  # the job has started: a later quorum of one is a survivor's
    group.begin_step()
    assert group.manager.started == 4 and group._open


def test_a_group_that_never_comes_stops_the_first_start_in_one_line_after_the_quorums_timeout(no_pause):
    group = first([quorum(0, FIRST_0)] * 3, timeout_s=1.0)  # 1 s / 0.5 s: two more tries
    with pytest.raises(UnifiedDistError) as caught:
        group.begin_step()
    assert str(caught.value) == (
        "replica group 0: the job's first step needs all 2 replica groups, but after 1 s its quorum held 1 "
        "(unified_dist_group_0): start every group against the lighthouse http://x within that time (unified-dist "
        "launch --replica-groups N starts them together), or set NUM_REPLICA_GROUPS to the groups you start")
    assert group.manager.started == 3 and not group._open  # no step runs


def test_a_group_on_its_first_start_that_meets_a_job_already_stepping_trains_at_once(no_pause):
    """Group 2 of 3 comes late to a job at step 7 that lost group 1: torchft heals it from group 0."""
    group = first([quorum(7, FIRST_0, "unified_dist_group_2")], groups=3)
    group.begin_step()
    assert group.manager.started == 1 and group._open


# --------------------------------------------------------------------------------------------------- buffers
def test_buffers_are_averaged_across_groups_inside_the_step_before_its_commit():
    """Issue #58: averaged after the commit, the buffers opened the next step's quorum (and armed its watchdog)
    after the job's last step. Now inside the step; after it only the group's rank 0 buffers are handed out."""
    from unified_dist.training.buffers import ModelBuffers

    averaged = []
    backend = SimpleNamespace(world_size=1, replicas=object(), communicates_at_prepare=True,
                              average_buffers_across_groups=lambda buffers: averaged.append(len(buffers)))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    buffers = ModelBuffers(backend)
    buffers.add(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    buffers.after_step(optimizer)
    assert averaged == []  # after the commit: nothing across groups
    buffers.before_commit(optimizer)
    assert averaged == [3]  # running_mean, running_var, num_batches_tracked (the backend keeps the floating ones)
    buffers.before_commit(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    assert averaged == [3]  # an optimizer of no model with buffers: nothing


def test_the_optimizer_averages_the_buffers_before_the_commit_decision():
    import contextlib

    from unified_dist.training.accumulation import PreparedOptimizer
    from unified_dist.training.buffers import ModelBuffers

    calls = []
    backend = SimpleNamespace(
        world_size=1, replicas=object(), communicates_at_prepare=True,
        step_context=lambda optimizer, finalized: contextlib.nullcontext(),
        average_buffers_across_groups=lambda buffers: calls.append("average the buffers across groups"),
        commit_step=lambda optimizer: calls.append("commit") or True)
    sync = SimpleNamespace(loaders=LoaderStack(), sync_gradients=True, stops=None, backward_calls=0, committed=True,
                           optimizers=[], loss_scale=lambda: None, rescale_others=lambda *a: None, optimizer_steps=0,
                           backend=backend, buffers=ModelBuffers(backend))
    model = torch.nn.BatchNorm1d(2)
    sync.buffers.add(model)
    sync.buffers.after_step = lambda optimizer: calls.append("rank 0's buffers")
    optimizer = PreparedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sync)
    optimizer.step(closure=lambda: None)
    assert calls == ["average the buffers across groups", "commit", "rank 0's buffers"]


# ------------------------------------------------------------------------------------------ evaluation passes
class Replicas(SimpleNamespace):
    def __init__(self, group=1, groups=2):
        super().__init__(layout=ReplicaLayout(group, groups, "http://x"), quorums=[], opened=False, paused=0)

    def begin_step(self):
        self.quorums.append(1)
        self.opened = True

    def pause_step(self):
        self.paused += 1


def session_with(model=None, per_group=2, rank_in_group=1, group=1, groups=2):
    """A session of rank ``rank_in_group`` of replica group ``group`` (``per_group`` ranks each)."""
    stack = LoaderStack()
    backend = SimpleNamespace(replicas=Replicas(group, groups), data_parallel_world_size=per_group * groups,
                              data_parallel_rank=group * per_group + rank_in_group, gives_metric_rows=True)
    session = Session(backend, None, None, stack, healable=[model] if model is not None else [])
    stack.before_batch = session.begin_replica_step
    stack.pass_topology = session._replica_pass_topology
    stack.pass_ended = session.end_replica_pass
    return session, stack


def prepared(stack, n=10, world=(3, 4)):
    data = torch.utils.data.TensorDataset(torch.arange(float(n)))
    return PreparedDataLoader(torch.utils.data.DataLoader(data, batch_size=2), lambda: world, torch.device("cpu"), 0,
                              stack)


def test_an_evaluation_pass_covers_the_whole_split_over_the_groups_own_ranks():
    """Issue #58: rank 1 of group 1 (of 2 groups of 2) shards an evaluation pass as rank 1 of 2: with its
    group's rank 0 it sees every example once, and the training pass keeps rank 3 of 4's share."""
    model = torch.nn.Linear(1, 1)
    session, stack = session_with(model)
    loader = prepared(stack)
    model.eval()
    seen = [batch[0].tolist() for batch in loader]
    assert seen == [[2.0, 3.0], [6.0, 7.0], [9.0]]  # rank 1's half of each global batch of 4 (the last: 1 of 2)
    assert loader.batch_sampler.world_size == 2 and session.backend.replicas.quorums == []  # no quorum held
    model.train()
    # training: rank 3 of 4's share of global batches of 8 (of the last 2, a padding row)
    assert [batch[0].tolist() for batch in loader] == [[6.0, 7.0], [8.0]]
    assert session.backend.replicas.quorums == [1, 1]  # a quorum before each batch


@pytest.mark.parametrize("why", ["no_grad", "eval", "another"])
def test_what_makes_a_pass_an_evaluation(why):
    model = torch.nn.Linear(1, 1)
    session, stack = session_with(model)
    loader, training = prepared(stack), prepared(stack)
    if why == "eval":
        model.eval()
    if why == "another":
        session._training_loader = training
    with torch.no_grad() if why == "no_grad" else torch.enable_grad():
        assert session._evaluation_pass(loader) is not None
    assert session._evaluation_pass(training) is None or why == "eval"
    if why == "eval":  # the training loader trains in eval mode once known (frozen BatchNorm)
        session._training_loader = training
        assert session._evaluation_pass(training) is None


def test_before_any_backward_a_pass_in_train_mode_with_gradients_on_trains():
    session, stack = session_with(torch.nn.Linear(1, 1))
    assert session._evaluation_pass(prepared(stack)) is None


def test_gather_for_metrics_in_an_evaluation_pass_gathers_inside_the_group_with_exact_counts(monkeypatch):
    from unified_dist.collectives import ops as collectives

    model = torch.nn.Linear(1, 1)
    session, stack = session_with(model)
    monkeypatch.setattr(collectives, "all_gather", lambda backend, x, what: torch.cat([x, x]))  # 2 ranks
    loader = prepared(stack, n=5)
    got = []
    with torch.no_grad():
        for (batch,) in loader:
            got.append(session.gather_for_metrics(batch))
    assert sum(len(g) for g in got) == 5  # the whole split, each example once (the padding row dropped)


def test_a_training_pass_still_refuses_gather_for_metrics_and_an_evaluation_pass_refuses_backward():
    model = torch.nn.Linear(1, 1)
    session, stack = session_with(model)
    loader = prepared(stack)
    for _ in loader:
        with pytest.raises(UnifiedDistError, match="in a training pass of a prepared loader") as caught:
            session.gather_for_metrics(torch.zeros(1))
        assert "\n" not in str(caught.value)
        break
    session.sync = SimpleNamespace(check_backward_context=lambda: None, backward_calls=0)
    session.loaders = stack
    with torch.no_grad():
        for _ in loader:
            with pytest.raises(UnifiedDistError, match="replica groups take for an evaluation") as caught:
                session.backward(torch.zeros(()))
            assert "gradients off" in str(caught.value) and "\n" not in str(caught.value)
            break


def test_a_training_loop_that_leaves_its_loader_with_a_quorum_held_stops_timing_that_step():
    """A ``break`` right after a fetch (the loop checks for its end at the top of its body): the step's quorum is
    held, and what the program does next (an evaluation, a save) must not be timed as that step's work."""
    model = torch.nn.Linear(1, 1)
    session, stack = session_with(model)
    training, evaluation = prepared(stack), prepared(stack)
    for _ in training:
        break  # the quorum was held for this batch
    assert session.backend.replicas.paused == 1
    model.eval()
    with torch.no_grad():
        for _ in evaluation:
            pass
    assert session.backend.replicas.paused == 1  # an evaluation pass's end changes nothing


def test_the_next_fetch_times_a_step_that_was_left_again():
    groups = restarted([quorum(5, FIRST_0, AGAIN_1)])
    groups.begin_step()
    assert groups._watchdog.armed
    groups.pause_step()
    assert not groups._watchdog.armed
    groups.begin_step()  # the training loader's next fetch: the same step, timed again, no new quorum
    assert groups._watchdog.armed and groups.manager.started == 1


def test_shutdown_stops_the_watchdog_of_a_step_still_open():
    groups = restarted([quorum(5, FIRST_0, AGAIN_1)])
    groups.manager.shutdown = lambda wait: None
    groups.begin_step()  # a quorum held, and never committed
    groups.shutdown()
    assert not groups._watchdog.armed
    groups._open = False
    groups.manager.quorums.append(quorum(6, FIRST_0, AGAIN_1))
    groups.begin_step()  # even a late quorum arms nothing any more
    assert not groups._watchdog.armed
