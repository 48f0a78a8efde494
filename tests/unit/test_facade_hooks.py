"""The facade's process hooks: atexit and sys.excepthook are installed once and never take over."""
import sys

import pytest

import unified_dist as ud
from unified_dist import (
    errors,
    session as facade,  # the session module owns the hooks
)


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


def test_seed_everything_seeds_the_loaders_shuffle():
    """API reference (seed_everything): it seeds the shuffle of loaders prepared after it (a seed that did nothing
    would give every seed the same data order)."""
    import torch
    ud.shutdown()
    ud.init(backend="single")
    try:
        ud.seed_everything(17)
        loader = ud.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(10)),
                                                        batch_size=10, shuffle=True))
        expected = torch.randperm(10, generator=torch.Generator().manual_seed(17)).tolist()
        assert next(iter(loader))[0].tolist() == expected
    finally:
        ud.shutdown()


@pytest.mark.parametrize("value,refused", [("0", False), ("1", True)])
def test_check_finite_off_lets_a_nan_loss_through(monkeypatch, value, refused):
    """docs/faults.md: a NaN loss stops before any update; UNIFIED_DIST_CHECK_FINITE=0 turns the check off."""
    import torch
    monkeypatch.setenv("UNIFIED_DIST_CHECK_FINITE", value)
    ud.shutdown()
    ud.init(backend="single")
    try:
        model = torch.nn.Linear(2, 1)
        model, opt = ud.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        before = [p.detach().clone() for p in model.parameters()]
        try:
            ud.backward(model(torch.ones(2, 2)).mean() * float("nan"))
            raised = False
        except ud.NonFiniteLoss:
            raised = True
        assert raised is refused
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    finally:
        ud.shutdown()


def test_gather_for_metrics_outside_a_loader_loop_warns_once(monkeypatch):
    """docs/common-mistakes.md: gather_for_metrics outside a prepared loader's loop warns, once."""
    import warnings

    import torch
    monkeypatch.setattr(errors, "_warned", set())
    ud.shutdown()
    ud.init(backend="single")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                ud.gather_for_metrics(torch.ones(2))
    finally:
        ud.shutdown()
    messages = [str(c.message) for c in caught if "outside the loop of a prepared DataLoader" in str(c.message)]
    assert len(messages) == 1, messages
