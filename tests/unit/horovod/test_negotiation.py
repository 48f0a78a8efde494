"""The negotiation's decisions (unified_dist/horovod/_negotiation.py), from rows built by hand.

Every member derives its plan from the same gathered rows, so the decisions are pure functions of
them; these tests pin them without a launch (tests/launchers/test_hvd_compat.py runs them for real,
under torchrun and against real Horovod under horovodrun)."""
from __future__ import annotations

from typing import List

import pytest
import torch

from unified_dist.horovod import _negotiation as neg
from unified_dist.horovod._ops import HorovodInternalError


def allreduce_row(shape=(3,), dtype=torch.float32, op=1, names=(), parts=1, count=None, device="cpu"):
    return neg.make_row(neg.ALLREDUCE, op, torch.empty(shape, dtype=dtype, device=device), parts=parts,
                        keys=[neg.key_of(n) for n in names], count=count)


def step_row(specs, op=0):
    return neg.make_row(neg.STEP, op, count=len(specs), sign=hash(tuple(specs)) & (2 ** 63 - 1))


def wait_row(names):
    return neg.make_row(neg.WAIT, keys=[neg.key_of(n) for n in names])


class FakeController(neg.Controller):
    """A controller whose exchanges return scripted rows (the other members' answers)."""

    def __init__(self, scripted: List[List[List[int]]], queues=None):
        super().__init__(None, [0, 1], 0, torch.device("cpu"), self._answer, self._answer_step)
        self.scripted, self.sent, self.answered, self.steps = list(scripted), [], [], []
        self.queues = queues  # the other member's whole queue, for gather_objects

    def _answer(self, row):
        self.answered.append(row)

    def _answer_step(self, rows, active):
        self.steps.append((rows, active))

    def gather_objects(self, obj):
        return [obj, self.queues]

    def exchange(self, row, doing):
        self.sent.append(row)
        rows = self.scripted.pop(0)
        rows[self.index] = row
        self.ticks += 1
        return rows

    def _deadlock(self, rows, doing):
        return HorovodInternalError(f"deadlock while {doing()}")


class Pending:
    def __init__(self, name):
        self.name, self.queued, self.error, self.started = name, True, None, None

    def start(self, started):
        self.started, self.queued = started, False

    def fail(self, error):
        self.error, self.queued = error, False


def queue(controller, name, kind_row_tensor=None, issued=None):
    tensor = torch.zeros(2) if kind_row_tensor is None else kind_row_tensor
    pending = Pending(name)
    part = neg.Part(neg.ALLREDUCE, 1, tensor, lambda rows, active: (issued.append(name), None) if issued
                    is not None else (None, None))
    controller.queue[neg.key_of(name)] = neg.Request(name, [part], pending)
    return pending


def test_named_operations_run_in_the_first_members_order_whatever_this_members_order():
    issued: List[str] = []
    # this member (index 0) queued b then a; member 1 queued a then b: the agreed order is member 0's
    # own list here, and the same list on member 1 (it reads the same rows), so both run b then a
    ctl = FakeController([
        [None, wait_row(["a", "b"])],
        [None, allreduce_row((2,))], [None, allreduce_row((2,))],
    ])
    pb, pa = queue(ctl, "b", issued=issued), queue(ctl, "a", issued=issued)
    ctl.wait(pa)
    assert issued == ["b", "a"] and not pa.queued and not pb.queued


def test_only_names_every_active_member_queued_run():
    issued: List[str] = []
    ctl = FakeController([
        [None, wait_row(["a"])],              # member 1 has only a: b waits
        [None, allreduce_row((2,))],
    ])
    pa, pb = queue(ctl, "a", issued=issued), queue(ctl, "b", issued=issued)
    ctl.wait(pa)
    assert issued == ["a"] and pb.queued and neg.key_of("b") in ctl.queue


def test_a_joined_member_does_not_hold_back_the_names_the_others_agree_on():
    issued: List[str] = []
    join_row = neg.make_row(neg.JOIN, joined=(0, 0))
    ctl = FakeController([[None, join_row], [None, join_row]])
    pa = queue(ctl, "a", issued=issued)
    ctl.wait(pa)
    assert issued == ["a"]


def test_a_tick_where_nothing_can_run_raises_instead_of_waiting_forever():
    ctl = FakeController([[None, allreduce_row((1,))]])  # member 1 blocks in an unnamed op, a is ours only
    pa = queue(ctl, "a")
    with pytest.raises(HorovodInternalError, match="deadlock while waiting for 'a'"):
        ctl.wait(pa)


def test_a_joined_member_answers_an_unnamed_allreduce_and_returns_the_last_to_join():
    ctl = FakeController([
        [None, allreduce_row((4,), torch.int32, op=0)],
        [None, neg.make_row(neg.JOIN, joined=(5, 10))],
    ])
    last = ctl.join()
    assert [neg.shape(r) for r in ctl.answered] == [(4,)] and neg.dtype(ctl.answered[0]) == torch.int32
    assert last == 1  # member 1 joined at tick 5, this one at tick 0


@pytest.mark.parametrize("other, fragment", [
    (allreduce_row((4,)), "rank 0: allreduce float32[3] op Sum; rank 1: allreduce float32[4] op Sum"),
    (allreduce_row((3,), torch.float64), "float64"),
    (allreduce_row((3,), op=0), "op Average"),
    (neg.make_row(neg.ALLGATHER, 0, torch.empty(3)), "allgather"),
    (allreduce_row((3,), parts=2), "rank 1: grouped allreduce of 2 tensors, tensor 1: float32[3] op Sum"),
    (allreduce_row((3,), parts=2, count=3), "grouped allreduce of 3 tensors, tensor 2: float32[3]"),
    (allreduce_row((3,), device="meta"), "rank 0: allreduce float32[3] op Sum on cpu; rank 1: allreduce "
                                         "float32[3] op Sum on meta"),
])
def test_rows_that_disagree_are_refused_naming_every_members_tensor(other, fragment):
    verdict = neg.problem([allreduce_row((3,)), other], [0, 1], [0, 1])
    assert verdict is not None and fragment in verdict and "\n" not in verdict


def test_allgather_rows_may_differ_in_the_first_dimension_only():
    rows = [neg.make_row(neg.ALLGATHER, 0, torch.empty(n, 2)) for n in (1, 5)]
    assert neg.problem(rows, [0, 1], [0, 1]) is None
    rows[1] = neg.make_row(neg.ALLGATHER, 0, torch.empty(5, 3))
    assert "Mismatched" in neg.problem(rows, [0, 1], [0, 1])


def test_only_allreduce_and_barrier_run_while_a_member_has_joined():
    join_row = neg.make_row(neg.JOIN)
    for kind in (neg.ALLGATHER, neg.BROADCAST, neg.ALLTOALL, neg.REDUCESCATTER):
        verdict = neg.problem([neg.make_row(kind, 0, torch.empty(2)), join_row], [0], [0, 1])
        assert "rank(s) [1] have called hvd.join()" in verdict
    assert neg.problem([allreduce_row(), join_row], [0], [0, 1]) is None
    assert neg.problem([neg.make_row(neg.BARRIER), join_row], [0], [0, 1]) is None


def test_a_name_key_is_stable_and_distinct():
    assert neg.key_of("grad.w") == neg.key_of("grad.w") != neg.key_of("grad.b")
    assert 0 <= neg.key_of("x") < 2 ** 63


def test_grouped_requests_of_different_counts_are_refused_at_their_first_tensor_naming_each_request():
    """Issue 58: rank 0 grouped_allreduce([a, b]), rank 1 grouped_allreduce([a, b, c]): the first tick
    already differs (each row carries its request's count), so neither rank runs a tensor of it."""
    rows = [allreduce_row((3,), parts=2), allreduce_row((3,), parts=3)]
    verdict = neg.problem(rows, [0, 1], [0, 1])
    assert verdict is not None and "\n" not in verdict
    assert ("rank 0: grouped allreduce of 2 tensors, tensor 1: float32[3] op Sum; "
            "rank 1: grouped allreduce of 3 tensors, tensor 1: float32[3] op Sum") in verdict


def test_an_unnamed_grouped_request_carries_its_count_in_every_tick():
    ctl = FakeController([[None, allreduce_row((2,), parts=2)], [None, allreduce_row((2,), parts=1, count=2)]])
    parts = [neg.Part(neg.ALLREDUCE, 1, torch.zeros(2), lambda rows, active: (None, lambda: None)) for _ in range(2)]
    for i, part in enumerate(parts):
        part.left, part.count = 2 - i, 2
        ctl.run_unnamed(part)
    assert [(r[neg._PARTS], r[neg._COUNT]) for r in ctl.sent] == [(2, 2), (1, 2)]


def test_a_step_runs_while_a_member_has_joined_and_the_joined_member_answers_it():
    specs = [(8, 3, 4), (8, 4)]
    assert neg.problem([step_row(specs), neg.make_row(neg.JOIN)], [0], [0, 1]) is None
    ctl = FakeController([[None, step_row(specs)], [None, neg.make_row(neg.JOIN, joined=(7, 1))]])
    assert ctl.join() == 1
    assert len(ctl.steps) == 1 and ctl.steps[0][1] == [1] and ctl.answered == []


@pytest.mark.parametrize("other", [[(8, 3, 4)], [(8, 3, 4), (8, 5)], [(9, 3, 4), (8, 4)]])
def test_steps_reducing_different_gradients_are_refused(other):
    verdict = neg.problem([step_row([(8, 3, 4), (8, 4)]), step_row(other)], [0, 1], [0, 1])
    assert verdict is not None and "DistributedOptimizer step reducing 2 gradients" in verdict


def test_names_beyond_the_rows_slots_are_compared_in_full_instead_of_a_false_deadlock():
    """Issue 58: this member queued SLOTS + 6 names; the other queued only the last 6 and waits for one.
    The rows carry this member's first SLOTS names, so they share none: the whole queues decide."""
    names = [f"n{i}" for i in range(neg.SLOTS + 6)]
    issued: List[str] = []
    late = [neg.key_of(n) for n in names[neg.SLOTS:]]
    ctl = FakeController([[None, wait_row(names[neg.SLOTS:])]] + [[None, allreduce_row((2,))] for _ in late],
                         queues=late)
    pendings = [queue(ctl, n, issued=issued) for n in names]
    ctl.wait(pendings[-1])
    assert issued == names[neg.SLOTS:] and ctl.sent[0][neg._QUEUED] == neg.SLOTS + 6


def test_a_transfer_that_fails_on_this_member_refuses_every_later_operation_in_one_line():
    def broken(rows, active):
        raise RuntimeError("Tensors must be contiguous\nmore")

    ctl = FakeController([[None, allreduce_row((2,))]])
    with pytest.raises(HorovodInternalError, match="failed on rank 0: RuntimeError: Tensors must be contiguous;"):
        ctl.run_unnamed(neg.Part(neg.ALLREDUCE, 1, torch.zeros(2), broken))
    for later in (lambda: ctl.run_unnamed(neg.Part(neg.ALLREDUCE, 1, torch.zeros(2), broken)), ctl.join,
                  lambda: ctl.wait(Pending("x"))):
        with pytest.raises(HorovodInternalError, match="out of step .* every later operation on it is refused") as info:
            later()
        assert "\n" not in str(info.value)
    assert len(ctl.sent) == 1  # nothing more was sent


def test_a_step_row_carries_its_gradients_count_and_a_signature_of_their_shapes(monkeypatch):
    """What gradient_step (unified_dist/horovod/_ops.py) ticks with: the rows of two steps compare equal
    only when they reduce the same number of gradients of the same dtypes and shapes."""
    from unified_dist.horovod import _ops

    ticked = []

    class Ticks:
        def run_unnamed(self, part):
            ticked.append(neg.make_row(part.kind, part.extra, part.tensor, part.left, count=part.count,
                                       sign=part.sign))
    monkeypatch.setattr(_ops, "_communicates", lambda ps: True)
    monkeypatch.setattr(_ops, "_controller", lambda ps: Ticks())
    for specs in ([(8, 3, 4), (8, 4)], [(8, 3, 4), (8, 4)], [(8, 4, 3), (8, 4)], [(8, 3, 4)], [(9, 3, 4), (8, 4)]):
        _ops.gradient_step(specs, _ops.Average, _ops.global_process_set)
    assert [r[neg._COUNT] for r in ticked] == [2, 2, 2, 1, 2]
    assert neg.problem(ticked[:2], [0, 1], [0, 1]) is None
    for other in ticked[2:]:
        assert "DistributedOptimizer step" in neg.problem([ticked[0], other], [0, 1], [0, 1])


class FakeAlarm:
    """What a member heard from the others (``heard``), what it told them, whether it closed its side."""

    def __init__(self, heard=None):
        self._heard, self.sounded, self.closed = heard, [], 0

    def heard(self):
        return self._heard

    def sound(self, message):
        self.sounded.append(message)
        self.closed += 1

    def close(self):
        self.closed += 1


def test_a_transfer_that_fails_on_this_member_tells_the_others_what_failed_and_lets_go_of_the_group():
    """Issue 58 item 8: the others, blocked in their share, must hear it now, not at the collective timeout."""
    def broken(rows, active):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory\nframe #0")

    ctl = FakeController([[None, allreduce_row((2,))]])
    ctl.alarm, ctl.group = FakeAlarm(), object()
    with pytest.raises(HorovodInternalError, match="the other ranks raise too") as info:
        ctl.run_unnamed(neg.Part(neg.ALLREDUCE, 1, torch.zeros(2), broken))
    told = ("an unnamed allreduce float32[2] op Sum failed on rank 0: RuntimeError: DefaultCPUAllocator: can't "
            "allocate memory")
    assert ctl.alarm.sounded == [told] and str(info.value).startswith(told)
    assert ctl.group is None  # nothing here holds the group any more: its connections close


def test_a_member_whose_tick_fails_after_another_failed_raises_what_that_member_told(monkeypatch):
    told = "an unnamed alltoall float64[0] failed on rank 1: RuntimeError: can't allocate memory"

    def closed(row, group, size, device):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:4242\nmore")
    monkeypatch.setattr(neg, "gather_rows", closed)
    ctl = neg.Controller(object(), [0, 1], 0, torch.device("cpu"), lambda row: None, alarm=FakeAlarm(told))
    with pytest.raises(HorovodInternalError) as info:
        ctl.run_unnamed(neg.Part(neg.ALLREDUCE, 1, torch.zeros(2), lambda rows, active: (None, lambda: None)))
    said = str(info.value)
    assert said.startswith(told + "; rank 0 was issuing an unnamed allreduce float32[2] op Sum") and "\n" not in said
    assert ctl.alarm.closed == 1 and ctl.alarm.sounded == [] and ctl.group is None  # passed on, not told again
    with pytest.raises(HorovodInternalError, match="out of step") as later:
        ctl.run_unnamed(neg.Part(neg.ALLREDUCE, 1, torch.zeros(2), lambda rows, active: (None, lambda: None)))
    assert told in str(later.value) and "refused" in str(later.value)


def test_a_transfer_that_fails_because_another_member_failed_first_says_what_that_member_told():
    told = "'grad.w' (allreduce float32[2] op Sum) failed on rank 1: RuntimeError: boom"

    def closed(rows, active):
        raise RuntimeError("Connection closed by peer")
    ctl = FakeController([[None, allreduce_row((2,))]])
    ctl.alarm = FakeAlarm(told)
    with pytest.raises(HorovodInternalError) as info:
        ctl.run_unnamed(neg.Part(neg.ALLREDUCE, 1, torch.zeros(2), closed))
    assert str(info.value).startswith(told + "; rank 0 was starting an unnamed allreduce")
    assert ctl.alarm.sounded == [] and ctl.alarm.closed == 1 and ctl.broken == told
