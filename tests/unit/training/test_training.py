"""Gradients are final (averaged, unscaled) before the user clips them, on every backend's own terms.

fp16 cannot run on this CPU machine, so the loss scalers here are fakes that multiply and divide
by a known factor; the backends are the real classes with their library objects replaced.
"""
from __future__ import annotations

import contextlib

import torch

from unified_dist.backends.accelerate_backend import AccelerateBackend
from unified_dist.backends.base import Config
from unified_dist.backends.horovod_backend import HorovodBackend
from unified_dist.backends.single import SingleProcessBackend
from unified_dist.data.loaders import LoaderStack
from unified_dist.detection import Detection
from unified_dist.training.accumulation import GradientSync, PreparedOptimizer

SCALE = 1024.0


class FakeScaler:
    """torch.amp.GradScaler's interface: unscale_ divides the gradients once per step."""

    def __init__(self):
        self.calls = []

    def unscale_(self, optimizer):
        self.calls.append("unscale_")
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad.div_(SCALE)

    def step(self, optimizer):
        self.calls.append("step")
        return optimizer.step()

    def update(self):
        self.calls.append("update")


def _scaled_gradient_setup(backend):
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.tensor([3.0, 4.0, 0.0]) * SCALE  # true gradient norm 5, scaled by SCALE
    inner = torch.optim.SGD([param], lr=1.0)
    sync = GradientSync(backend, LoaderStack())
    return param, inner, sync


def _clip_like_the_facade(prepared, param):
    prepared.synchronize()
    return torch.nn.utils.clip_grad_norm_([param], max_norm=1.0).item()


def test_own_scaler_unscales_once_per_step_before_clipping():
    backend = SingleProcessBackend(Detection("single", "python", "test"), Config())
    param, inner, sync = _scaled_gradient_setup(backend)
    scaler = FakeScaler()
    prepared = PreparedOptimizer(inner, sync, scaler)
    sync.backward_calls += 1  # the gradient stands for one ud.backward call (PreparedOptimizer checks)
    assert _clip_like_the_facade(prepared, param) == 5.0  # the norm of the true gradient
    prepared.synchronize()  # a second clip in the same step must not unscale again
    prepared.step()
    assert scaler.calls == ["unscale_", "step", "update"]
    param.grad = torch.tensor([0.0, 6.0, 8.0]) * SCALE
    sync.backward_calls += 1
    assert _clip_like_the_facade(prepared, param) == 10.0  # the next step is unscaled again
    assert scaler.calls.count("unscale_") == 2


class FakeAccelerator:
    """Accelerate owns the fp16 scaler: clipping must go through accelerator.unscale_gradients."""

    def __init__(self):
        self.scaler = FakeScaler()

    def unscale_gradients(self, optimizer=None):
        self.scaler.unscale_(optimizer)


def test_accelerate_backend_unscales_through_accelerate_before_clipping():
    backend = AccelerateBackend.__new__(AccelerateBackend)  # its Accelerator replaced by the fake
    backend.config, backend.accelerator = Config(mixed_precision="fp16"), FakeAccelerator()
    assert backend.make_grad_scaler() is None  # the facade has no scaler of its own here
    param, inner, sync = _scaled_gradient_setup(backend)
    prepared = PreparedOptimizer(inner, sync, None)
    assert _clip_like_the_facade(prepared, param) == 5.0
    prepared.synchronize()
    assert backend.accelerator.scaler.calls == ["unscale_"]


def test_accelerate_backend_backward_scales_by_accelerates_scaler_and_weights_like_every_backend():
    """``loss * weight`` times Accelerate's fp16 loss scale, whatever Accelerate's accumulation count:
    not ``accelerator.backward``, which would divide by that count again (k = 4 here)."""
    from fractions import Fraction

    class Scaling(FakeScaler):
        def scale(self, loss):
            return loss * SCALE

    backend = AccelerateBackend.__new__(AccelerateBackend)
    backend.config, backend.accelerator = Config(gradient_accumulation_steps=4), FakeAccelerator()
    backend.accelerator.scaler = Scaling()
    param = torch.nn.Parameter(torch.ones(2))
    sync = GradientSync(backend, LoaderStack())  # what ud.backward hands the backend
    backend.backward((param * torch.tensor([1.0, 2.0])).sum(), sync.loss_scaler(), Fraction(1, 4))
    assert param.grad.tolist() == [SCALE / 4, 2 * SCALE / 4]


class FakeDistributedOptimizer(torch.optim.SGD):
    """horovod.torch.DistributedOptimizer's synchronize()/skip_synchronize() protocol."""

    def __init__(self, params):
        super().__init__(params, lr=1.0)
        self.events = []

    def synchronize(self):
        self.events.append("synchronize")

    @contextlib.contextmanager
    def skip_synchronize(self):
        self.events.append("skip")
        yield

    def step(self, closure=None):
        self.events.append("step")
        return super().step(closure)


def test_horovod_backend_averages_then_unscales_and_step_skips_a_second_wait():
    backend = HorovodBackend.__new__(HorovodBackend)  # no hvd needed: the optimizer is the fake
    backend.config = Config(mixed_precision="fp16")
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.tensor([3.0, 4.0, 0.0]) * SCALE
    inner = FakeDistributedOptimizer([param])
    scaler = FakeScaler()
    sync = GradientSync(backend, LoaderStack())
    prepared = PreparedOptimizer(inner, sync, scaler)
    sync.backward_calls += 1  # as after one ud.backward
    assert _clip_like_the_facade(prepared, param) == 5.0
    prepared.step()
    assert inner.events == ["synchronize", "skip", "step"] and scaler.calls[0] == "unscale_"
    prepared.zero_grad()
    param.grad = torch.ones(3)
    sync.backward_calls += 1
    prepared.step()  # no clip this time: horovod's own step() waits for the averaging itself
    assert inner.events[-1] == "step" and inner.events.count("skip") == 1


def test_clip_waits_for_every_prepared_optimizer_first(monkeypatch):
    """API reference, clip_grad_norm_: it clips the averaged gradients, so it first waits for the averaging
    (Horovod's is asynchronous): every prepared optimizer's synchronize() runs before the norm."""
    import unified_dist as ud
    calls = []
    real = PreparedOptimizer.synchronize

    def counted(self):
        calls.append("synchronize")
        return real(self)
    monkeypatch.setattr(PreparedOptimizer, "synchronize", counted)
    ud.shutdown()
    ud.init(backend="single")
    try:
        model = torch.nn.Linear(2, 1)
        model, opt = ud.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with ud.accumulate(model):
            ud.backward(model(torch.ones(2, 2)).sum())
            norm = ud.clip_grad_norm_(model.parameters(), 1e-3)
            assert calls == ["synchronize"], calls
            opt.step()
    finally:
        ud.shutdown()
    assert norm is not None and float(norm) > 1e-3


# ----------------------------------------------------------------- issue #46 item 9: one loss scale, several optimizers
def _two_model_run(k, scaler_factory=None, monkeypatch=None):
    """A discriminator/generator pair, two SGD optimizers, 4 batches, k micro-batches a step: through the
    facade (its backend's scaler from ``scaler_factory``), or in plain torch without any scaling (``None``)."""
    import unified_dist as ud
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    batches = [torch.randn(4, 2, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    if scaler_factory is None:
        for i, z in enumerate(batches):
            last = (i + 1) % k == 0
            (disc(z).pow(2).mean() / k).backward()
            if last:
                opt_d.step(), opt_d.zero_grad()
            (-disc(gen(z)).mean() / k).backward()  # reaches the discriminator too, as a GAN's does
            if last:
                opt_g.step(), opt_g.zero_grad()
        return gen, disc
    monkeypatch.setattr(SingleProcessBackend, "make_grad_scaler", lambda self: scaler_factory())
    ud.init(gradient_accumulation_steps=k)
    try:
        gen, disc, opt_g, opt_d = ud.prepare(gen, disc, opt_g, opt_d)
        for z in batches:
            with ud.accumulate(disc):
                ud.backward(disc(z).pow(2).mean())
                opt_d.step(), opt_d.zero_grad()
            with ud.accumulate(gen):
                ud.backward(-disc(gen(z)).mean())
                opt_g.step(), opt_g.zero_grad()
        assert opt_g.scaler is opt_d.scaler  # one scaler, as Accelerate's
        return gen, disc
    finally:
        ud.shutdown()


def test_two_optimizers_share_one_loss_scale_and_held_gradients_follow_its_changes(monkeypatch):
    """fp16 with two optimizers (a GAN): every ud.backward is scaled by the scale each optimizer unscales
    by, also when the scale grows after every update (growth_interval=1) and micro-batches accumulate:
    the same weights as plain torch without scaling (powers of two scale exactly): gradients an optimizer
    still holds when another one changes the scale are rescaled."""
    for k in (1, 2):
        expected = _two_model_run(k)
        got = _two_model_run(k, lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1),
                             monkeypatch)
        for model, ref in zip(got, expected):
            for p, q in zip(model.parameters(), ref.parameters()):
                assert torch.allclose(p, q, atol=1e-6, rtol=0), (k, p, q)


def test_an_accumulate_block_inside_another_is_refused_with_the_one_block_spelling():
    """docs/several-models.md: a block inside another is refused, naming `ud.accumulate(generator, discriminator)`."""
    import pytest

    import unified_dist as ud
    ud.init(gradient_accumulation_steps=2)
    try:
        gen, disc = ud.prepare(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        with pytest.raises(ud.UnifiedDistError, match=r"ud\.accumulate\(generator, discriminator\)") as info:
            with ud.accumulate(gen):
                with ud.accumulate(disc):
                    pass
        assert "\n" not in str(info.value)
        with ud.accumulate(gen, disc):  # the spelling it names works
            assert not ud.sync_gradients()
    finally:
        ud.shutdown()
