"""One dict of live objects goes to ``ud.save``/``ud.save_checkpoint`` and to ``ud.load(path, state)``.

In process, single backend: the saved run is continued twice, once uninterrupted (the reference:
the live objects that were saved, never a value read back from the file) and once from fresh
objects restored by ``ud.load``; both must take bitwise the same steps. The RNG entry is checked
the same way (draws after the load equal the draws after the save), the scheduler against the
learning rate computed here from the new lambda, and ElasticState's checkpoints in both directions.
The multi-process part (every rank's generators; ``if ud.is_main():`` refused) launches torchrun.
"""
import os
import random

import numpy
import pytest
import torch

import unified_dist as ud
from unified_dist.checkpoint import files as checkpoint

LR = 0.1


@pytest.fixture(autouse=True)
def fresh_facade():
    ud.shutdown()
    yield
    ud.shutdown()


def _objects(seed, decay=lambda step: 0.5 ** step):
    """A BatchNorm model, AdamW, a LambdaLR with ``decay`` and a shuffled loader, all prepared."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.3),
                                torch.nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(40, 3, generator=g), torch.randn(40, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    return ud.prepare(model, optimizer, loader, scheduler)


def _train(model, optimizer, loader, scheduler, iterator, steps):
    """``steps`` optimizer steps from ``iterator`` over ``loader`` (dropout draws from the torch RNG)."""
    model.train()
    for _ in range(steps):
        x, y = next(iterator)
        with ud.accumulate(model):
            ud.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def _draws():
    return torch.rand(3).tolist(), random.random(), float(numpy.random.rand())


def test_the_same_dict_saves_and_restores_every_live_object(tmp_path):
    """Model, optimizer (with its step count), scheduler, loader position, generators and plain
    values: the restored objects continue exactly as the saved ones do."""
    ud.seed_everything(0)
    model, optimizer, loader, scheduler = _objects(0)
    iterator = iter(loader)
    _train(model, optimizer, loader, scheduler, iterator, 3)
    path = str(tmp_path / "c.pt")
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "rng": ud.RNG,
             "epoch": 0, "note": "three steps"}
    ud.save(state, path)
    after_save = _draws()
    _train(model, optimizer, loader, scheduler, iterator, 2)  # the uninterrupted run, from the saved objects

    model2, optimizer2, loader2, scheduler2 = _objects(1)  # other initial weights and generator states
    state2 = {"model": model2, "optimizer": optimizer2, "scheduler": scheduler2, "loader": loader2, "rng": ud.RNG,
              "epoch": 7}
    assert ud.load(path, state2) == {"note": "three steps"}  # what state2 does not name comes back
    assert state2["epoch"] == 0 and state2["rng"] is ud.RNG  # plain values replaced; the marker stays
    assert optimizer2.steps_taken == 3
    assert scheduler2.last_epoch == 3 and optimizer2.param_groups[0]["lr"] == LR * 0.5 ** 3
    assert _draws() == after_save
    _train(model2, optimizer2, loader2, scheduler2, iter(loader2), 2)  # the resumed run
    for (name, a), b in zip(ud.unwrap(model).state_dict().items(), ud.unwrap(model2).state_dict().values()):
        assert torch.equal(a, b), name  # weights and BatchNorm statistics, bitwise
    assert optimizer2.steps_taken == optimizer.steps_taken == 5
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    assert loader2.state_dict() == loader.state_dict()


def test_a_checkpoint_saved_right_after_a_load_holds_the_same_position(tmp_path):
    """Load, then save before iterating (e.g. a commit at the top of a resumed loop): the loader's
    state is still the one loaded, mid-epoch, not the start of that epoch."""
    model, optimizer, loader, scheduler = _objects(0)
    _train(model, optimizer, loader, scheduler, iter(loader), 3)
    ud.save({"loader": loader}, str(tmp_path / "a.pt"))
    _, _, loader2, _ = _objects(1)
    ud.load(str(tmp_path / "a.pt"), {"loader": loader2})
    ud.save({"loader": loader2}, str(tmp_path / "b.pt"))
    assert ud.load(str(tmp_path / "b.pt"))["loader"] == {"epoch": 0, "samples_consumed": 3 * 4, "num_samples": 40,
                                                        "seed": 0}


def test_a_lambda_scheduler_takes_this_runs_schedule_whatever_the_dict_order(tmp_path):
    """A resume with a longer schedule (e.g. a larger --max-steps) takes the new schedule's rate on
    its very next step, though the optimizer's state (loaded after it, here) holds the old rate."""
    model, optimizer, loader, scheduler = _objects(0, decay=lambda step: 1 - step / 10)
    _train(model, optimizer, loader, scheduler, iter(loader), 4)
    path = str(tmp_path / "c.pt")
    ud.save({"model": model, "optimizer": optimizer, "scheduler": scheduler}, path)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(LR * (1 - 4 / 10))  # the old schedule's rate
    for order in (("scheduler", "optimizer", "model"), ("model", "optimizer", "scheduler")):
        objects = dict(zip(("model", "optimizer", "loader", "scheduler"),
                           _objects(1, decay=lambda step: 1 - step / 20)))  # a schedule twice as long
        ud.load(path, {name: objects[name] for name in order})
        expected = LR * (1 - 4 / 20)
        assert objects["optimizer"].param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12), order
        assert objects["scheduler"].get_last_lr() == pytest.approx([expected], rel=1e-12), order
        ud.shutdown()


def test_a_multiplicative_scheduler_keeps_the_rate_it_loaded(tmp_path):
    """Only LambdaLR computes its rate from the step alone; MultiplicativeLR's is a product of every
    earlier factor, which the optimizer's state holds."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.MultiplicativeLR(optimizer, lambda step: 0.5)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    path = str(tmp_path / "c.pt")
    ud.save({"optimizer": optimizer, "scheduler": scheduler}, path)
    fresh = torch.nn.Linear(2, 1)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=LR)
    fresh_scheduler = torch.optim.lr_scheduler.MultiplicativeLR(fresh_optimizer, lambda step: 0.9)
    ud.load(path, {"scheduler": fresh_scheduler, "optimizer": fresh_optimizer})
    assert fresh_optimizer.param_groups[0]["lr"] == pytest.approx(LR * 0.5 ** 3, rel=1e-12)


def test_the_step_count_travels_and_plain_optimizers_and_old_checkpoints_load(tmp_path):
    model, optimizer, loader, scheduler = _objects(0)
    _train(model, optimizer, loader, scheduler, iter(loader), 2)
    saved = optimizer.state_dict()
    assert saved["steps_taken"] == 2 and set(saved) == {"state", "param_groups", "steps_taken"}
    plain = torch.optim.AdamW(_objects(1)[0].parameters(), lr=LR)  # a torch optimizer ignores the extra key
    plain.load_state_dict(saved)
    for a, b in zip(optimizer.state_dict()["state"].values(), plain.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    old = {k: v for k, v in saved.items() if k != "steps_taken"}  # written before the count was saved
    path = str(tmp_path / "old.pt")
    ud.save({"model": model.state_dict(), "optimizer": old}, path)  # state dicts passed by hand, as before
    model2, optimizer2, _, _ = _objects(1)
    ud.load(path, {"model": model2, "optimizer": optimizer2})
    assert optimizer2.steps_taken == 0 and optimizer2.state_dict()["state"]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))


def test_the_rng_entry_is_every_ranks_generators(tmp_path):
    """In the file ``ud.RNG`` is the list ``ud.rng_states()`` gives (one entry per rank), which
    ``ud.restore_rng_states`` also takes; ``ud.load(path)`` returns it as it is."""
    ud.seed_everything(3)
    path = str(tmp_path / "c.pt")
    ud.save({"rng": ud.RNG, "nested": {"rng": ud.RNG}}, path)
    after_save = _draws()
    saved = ud.load(path)
    assert isinstance(saved["rng"], list) and len(saved["rng"]) == ud.world_size() == 1
    assert saved["nested"]["rng"][0]["python"][0] == random.getstate()[0]  # nested markers are replaced too
    ud.restore_rng_states(saved["rng"])
    assert _draws() == after_save
    ud.seed_everything(4)
    ud.load(path, {"rng": ud.RNG})
    assert _draws() == after_save


def test_strict_false_skips_names_the_file_lacks(tmp_path):
    model = torch.nn.Linear(2, 1)
    path = str(tmp_path / "c.pt")
    ud.save({"model": model, "step": 3}, path)
    bigger = torch.nn.Linear(2, 1)
    bigger.register_buffer("extra", torch.ones(1))  # a key the file lacks
    state = {"model": bigger, "step": 0, "epoch": 5}
    with pytest.raises(ud.CheckpointError, match="has no 'epoch'"):
        ud.load(path, state)
    assert ud.load(path, state, strict=False) == {}
    assert state["step"] == 3 and state["epoch"] == 5 and torch.equal(bigger.weight, model.weight)


def test_sharded_checkpoints_take_the_rng_entry_too(tmp_path):
    """save_sharded/load_sharded (one process: DCP runs without a process group) with the same dict."""
    ud.seed_everything(0)
    model, optimizer = _elastic_objects(0)
    _step(model, optimizer)
    ud.save_sharded({"model": model, "optimizer": optimizer, "rng": ud.RNG, "step": 1}, str(tmp_path / "ck"))
    after_save = _draws()
    model2, optimizer2 = _elastic_objects(1)
    assert ud.load_sharded({"model": model2, "optimizer": optimizer2, "rng": ud.RNG}, str(tmp_path / "ck")) == \
        {"step": 1}
    assert _draws() == after_save
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


# --------------------------------------------------------------------------- ElasticState layout
def _elastic_objects(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer = ud.prepare(model, optimizer)
    return model, optimizer


def _step(model, optimizer):
    ud.backward(model(torch.ones(2, 3)).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()


def test_an_elastic_checkpoint_is_a_save_checkpoint_of_the_same_dict(tmp_path):
    ud.seed_everything(0)
    model, optimizer = _elastic_objects(0)
    _step(model, optimizer)
    directory = str(tmp_path / "elastic")
    elastic = ud.ElasticState(model=model, optimizer=optimizer, step=1, epoch=0, checkpoint_dir=directory)
    elastic.commit()  # single process: the checkpoint on disk
    after_save = _draws()
    path = ud.latest_checkpoint(directory)
    raw = ud.load(path)
    assert set(raw) == {"model", "optimizer", "step", "epoch", "rng"}  # flat: name -> state or value
    model2, optimizer2 = _elastic_objects(1)
    state = {"model": model2, "optimizer": optimizer2, "step": 0, "epoch": 5, "rng": ud.RNG}
    assert ud.load(path, state) == {}
    assert (state["step"], state["epoch"], optimizer2.steps_taken) == (1, 0, 1)
    assert _draws() == after_save
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(optimizer.state_dict()["state"][0]["momentum_buffer"],
                       optimizer2.state_dict()["state"][0]["momentum_buffer"])


def test_elastic_state_resumes_from_a_save_checkpoint(tmp_path):
    ud.seed_everything(0)
    model, optimizer = _elastic_objects(0)
    _step(model, optimizer)
    directory = str(tmp_path / "ckpts")
    ud.save_checkpoint({"model": model, "optimizer": optimizer, "step": 1, "epoch": 2, "rng": ud.RNG}, directory, 1)
    after_save = _draws()
    model2, optimizer2 = _elastic_objects(1)
    elastic = ud.ElasticState(model=model2, optimizer=optimizer2, step=0, epoch=0, checkpoint_dir=directory)
    assert elastic.restored_from == os.path.join(directory, "checkpoint-000000001.pt")
    assert (elastic.step, elastic.epoch, optimizer2.steps_taken) == (1, 2, 1)
    assert _draws() == after_save
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_elastic_state_still_reads_its_old_nested_layout(tmp_path):
    """What ElasticState wrote before the flat layout: ``{"objects": {name: state}, "values": {...},
    "rng": ud.rng_states()}``, written here by hand."""
    ud.seed_everything(0)
    model, optimizer = _elastic_objects(0)
    _step(model, optimizer)
    directory = str(tmp_path / "old")
    old = {"objects": {"model": ud.unwrap(model).state_dict(), "optimizer": optimizer.optimizer.state_dict()},
           "values": {"step": 1, "epoch": 3}, "rng": ud.rng_states()}
    checkpoint.write_atomic(old, checkpoint.checkpoint_path(directory, 1))
    after_save = _draws()
    model2, optimizer2 = _elastic_objects(1)
    elastic = ud.ElasticState(model=model2, optimizer=optimizer2, step=0, epoch=0, checkpoint_dir=directory)
    assert (elastic.step, elastic.epoch) == (1, 3)
    assert _draws() == after_save
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert optimizer2.state_dict()["state"]


def test_elastic_snapshots_roll_back_in_memory(tmp_path):
    """Horovod's in-memory commit: ``snapshot()`` then ``apply()`` puts objects, values and this
    rank's generators back; ``restore_rng=False`` (a late joiner taking rank 0's state) keeps its own."""
    ud.seed_everything(0)
    model, optimizer = _elastic_objects(0)
    elastic = ud.ElasticState(model=model, optimizer=optimizer, step=0)
    snap = elastic.snapshot()
    after_snapshot = _draws()
    weights = [p.detach().clone() for p in model.parameters()]
    _step(model, optimizer)
    elastic.step = 1
    elastic.apply(snap)
    assert elastic.step == 0 and _draws() == after_snapshot
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    elastic.apply(snap, restore_rng=False)
    assert _draws() != after_snapshot and "rng" not in elastic._values
    with pytest.raises(ud.UnifiedDistError, match="'rng' is where its checkpoints keep"):
        ud.ElasticState(model=model, rng=1)


# --------------------------------------------------------------------------- two processes
RNG_WORKER = r'''
import os, random, sys, time
import torch
import unified_dist as ud
from unified_dist import saving
from unified_dist.checkpoint import rng as rng

saving.ARRIVAL_SECONDS = 3                            # how long rank 0 waits for the others (20 s by default)
out = sys.argv[1]
ud.init(timeout=60)
ud.seed_everything(0, per_rank=True)                  # every rank's generators differ
path = os.path.join(out, "rng.pt")
ud.save({"rng": ud.RNG, "step": 4}, path)            # every rank calls it
after_save = (torch.rand(2).tolist(), random.random())
ud.seed_everything(9)
ud.load(path, {"rng": ud.RNG})                        # each rank takes its own states back
restored = (torch.rand(2).tolist(), random.random())
every = ud.all_gather_object(after_save)
# a checkpoint of one process: rank r takes states[r % 1], so every rank draws what rank 0 drew after its capture
one = os.path.join(out, "one.pt")
if ud.is_main():
    torch.save({"rng": [rng.capture()]}, one)
    single = (torch.rand(2).tolist(), random.random())
ud.barrier()
ud.load(one, {"rng": ud.RNG})
fewer = ud.all_gather_object((torch.rand(2).tolist(), random.random()))
outcome, start = "returned", time.monotonic()
if ud.is_main():
    try:
        ud.save({"rng": ud.RNG}, os.path.join(out, "main_only.pt"))   # the DDP habit: would hang
    except ud.UnifiedDistError as exc:
        outcome = str(exc)
elapsed = time.monotonic() - start
ud.barrier()
with open(os.path.join(out, f"rank{ud.rank()}.txt"), "w") as f:
    f.write(repr({"same": restored == after_save, "distinct": every[0] != every[1], "outcome": outcome,
                  "fewer": fewer[0] == fewer[1] and (not ud.is_main() or fewer[0] == single),
                  "elapsed": elapsed, "rng_entries": len(ud.load(path)["rng"])}))
'''


@pytest.mark.distributed
@pytest.mark.slow
def test_every_rank_restores_its_own_generators_and_main_only_saves_are_refused(tmp_path):
    from unified_dist.testing.launchers import launch

    script = tmp_path / "rng_worker.py"
    script.write_text(RNG_WORKER)
    launch("torchrun", str(script), [str(tmp_path)], nproc=2, timeout=180).check()
    ranks = [eval((tmp_path / f"rank{r}.txt").read_text()) for r in range(2)]
    for r, got in enumerate(ranks):
        assert got["same"] and got["distinct"] and got["fewer"] and got["rng_entries"] == 2, (r, got)
    outcome = ranks[0]["outcome"]
    assert outcome.startswith("ud.save() of ud.RNG is collective, but rank(s) 1 did not call it within 3 s"), outcome
    assert "`if ud.is_main(): ud.save(...)` hangs" in outcome and "\n" not in outcome
    assert ranks[0]["elapsed"] < 15  # the worker's ARRIVAL_SECONDS (3) and a margin, not the 60 s timeout
    assert not (tmp_path / "main_only.pt").exists()


def test_main_only_collective_saves_are_refused_within_20_s_by_default():
    """docs/checkpoints.md: rank 0 names the ``if ud.is_main():`` mistake within 20 s, unless the collective timeout
    is shorter. The launches that check the refusal shorten the wait (3 s), so the default is checked here, on a
    backend whose peers never arrive: the wait it asks for and the seconds the message names."""
    from datetime import timedelta
    from types import SimpleNamespace

    from unified_dist import saving

    asked = []

    def missing_peers(what, seconds):
        asked.append(seconds)
        return [1]

    for timeout, expected in ((timedelta(minutes=30), 20), (timedelta(seconds=7), 7)):
        backend = SimpleNamespace(config=SimpleNamespace(timeout=timeout), missing_peers=missing_peers)
        with pytest.raises(ud.UnifiedDistError, match=f"rank\\(s\\) 1 did not call it within {expected} s;"):
            saving._every_rank_calls(backend, "save")
        assert asked[-1] == expected
