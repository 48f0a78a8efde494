"""How a process set's members hear that one member's transfer failed (unified_dist/horovod/_alarm.py), over
a dictionary standing in for the job's key-value store (tests/launchers/test_hvd_compat.py runs it for real:
a_transfer_that_fails_on_one_rank_raises_on_every_rank_at_once)."""
from __future__ import annotations

from unified_dist.horovod._alarm import Alarm, forget_frames


class Store:
    def __init__(self):
        self.keys = {}

    def set(self, key, value):
        self.keys[key] = value

    def check(self, keys):
        return all(k in self.keys for k in keys)

    def get(self, key):
        return self.keys[key]


def test_a_member_hears_what_the_others_told_and_not_its_own_nor_another_sessions():
    store, closed = Store(), []
    members = {r: Alarm("token/1", [0, 1, 2], r, lambda r=r: closed.append(r), store=lambda: store) for r in range(3)}
    elsewhere = Alarm("other/1", [0, 1, 2], 0, lambda: None, store=lambda: store)
    assert members[0].heard() is None
    members[1].sound("'x' failed on rank 1: RuntimeError: boom")
    assert closed == [1]  # telling closes the teller's side
    assert members[0].heard() == members[2].heard() == "'x' failed on rank 1: RuntimeError: boom"
    assert members[1].heard() is None and elsewhere.heard() is None
    members[2].sound("'x' failed on rank 2: RuntimeError: too")
    assert members[0].heard() == "'x' failed on rank 1: RuntimeError: boom; 'x' failed on rank 2: RuntimeError: too"


def test_without_a_store_a_member_hears_nothing_and_still_closes():
    def gone():
        raise RuntimeError("no default store")
    closed = []
    alarm = Alarm("t/0", [0, 1], 0, lambda: closed.append(0), store=gone)
    alarm.sound("failed")
    assert alarm.heard() is None and closed == [0]


def test_forgetting_frames_releases_what_they_held():
    import weakref

    class Group:
        pass

    def fail(group):
        raise RuntimeError("inside the transfer")

    group = Group()
    held = weakref.ref(group)
    try:
        fail(group)
    except RuntimeError as exc:
        error = exc
    del group
    assert held() is not None  # the traceback's frame still holds it
    forget_frames(error)
    assert held() is None
