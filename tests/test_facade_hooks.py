"""The facade's process hooks: atexit and sys.excepthook are installed once and never take over."""
import sys

import pytest

import unified_dist as ud
from unified_dist import session as facade  # the session module owns the hooks


@pytest.fixture
def fresh_hooks(monkeypatch):
    """A process in which unified_dist has installed nothing yet; atexit registrations counted."""
    ud.shutdown()
    registered = []
    monkeypatch.setattr(facade, "_hooks_installed", False)
    monkeypatch.setattr(facade, "_previous_excepthook", None)
    monkeypatch.setattr(facade.atexit, "register", registered.append)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    yield registered
    ud.shutdown()


def test_init_twice_installs_atexit_and_the_excepthook_once(fresh_hooks):
    ud.init(backend="single")
    ud.shutdown()
    ud.init(backend="single")
    assert fresh_hooks == [facade._shutdown_at_exit]
    assert sys.excepthook is facade._note_failure


def test_our_hook_marks_the_session_failed_and_calls_the_hook_it_replaced(fresh_hooks, monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *info: seen.append(info[0]))
    ud.init(backend="single")
    sys.excepthook(KeyError, KeyError("x"), None)
    assert seen == [KeyError]
    assert facade._session.failed


def test_a_user_hook_installed_after_init_is_kept_and_runs(fresh_hooks):
    ud.init(backend="single")
    seen = []

    def user_hook(*info):
        seen.append(info[0])

    sys.excepthook = user_hook
    ud.shutdown()
    ud.init(backend="single")  # a later init must not put ours back in front
    assert sys.excepthook is user_hook
    sys.excepthook(ValueError, ValueError("x"), None)
    assert seen == [ValueError]


def test_seed_and_failure_flag_belong_to_the_session(fresh_hooks):
    ud.init(backend="single")
    ud.seed_everything(17)
    assert facade._session.seed == 17 and not facade._session.failed
    ud.shutdown()
    ud.init(backend="single")
    assert facade._session.seed == 0
