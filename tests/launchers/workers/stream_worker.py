"""Streams (``IterableDataset`` loaders through ``ud.prepare``, issue 27), checked inside every rank of a
real launch.

    <launcher> tests/launchers/workers/stream_worker.py --out DIR --tag NAME --csv-one A.csv --csv-two B.csv,C.csv
                                              [--resume-from TAG] [--resume-split-from TAG] [--only resume]
    python tests/launchers/workers/stream_worker.py ... --ud-launch 2        (ud.launch starts 2 workers)

Every check runs on every rank in the same order, does its collectives first and asserts afterwards,
so a failing rank does not hang the others. Results go to DIR/<tag>_rank<R>.json as
{"identity": ..., "results": {check: "ok" | "FAIL: ..."}, "measured": ...}. Each launch also writes
DIR/<tag>_resume.json (rank 0): a mid-epoch loader state and the rows the uninterrupted run went on
with, which a later launch at another world size loads (``--resume-from TAG``). Expected values come
from plain arithmetic and plain single-process torch, never from the facade.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
from torch.utils.data import DataLoader, IterableDataset

import unified_dist as ud

ROWS, PER_RANK, EPOCHS = 101, 4, 2  # 101 = 12 x 8 + 5 under 2 ranks: the last global batch splits 3/2
EVAL_ROWS, EVAL_PER_RANK = 37, 3  # 37 = 6 x 6 + 1 under 2 ranks: the last global batch has a padding row
SEED, BUFFER = 1234, 16
LR = 0.05
RESUME_STEPS = 3  # the state is taken after this many steps of the second epoch
SPLIT_RESUME_STEPS = (3, 5)  # split states: while every rank has rows left, and once rank 1's 13 rows ran out
SPLIT_SHARDS = (30, 13)  # a generic dataset with 2 uneven shards (read by shards under 1 and 2 ranks)
LONG_SHARDS = (29, 70)  # batch 1: 70 steps, past two exchanges of counts (every 32); rank 0 pads from step 29
WORKER_ROWS = 45
WORKER_START = "forkserver"
"""How DataLoader workers start here. Not ``fork``: on the project's CPython 3.11.7 a child forked while
another thread of the rank holds the runtime's lock deadlocks in ``PyOS_AfterFork_Child`` (CPython
gh-112275, not fixed in 3.11.7); with a rank's queue-feeder, tqdm and backend threads that happened in 3
of about 30 launches under mpirun (gdb: the worker stuck in ``_PyThreadState_DeleteExcept``, its rank
waiting for batches, the other rank in the next collective). The forkserver forks from a process
without those threads; what the checks look at (how the workers share the stream) is the same.

The forkserver imports this script (and so torch and unified_dist) once, before it forks a worker
(:data:`PRELOAD`, set in :func:`run_all`): without it each of a rank's 6 workers imported them anew, 20-27 s
of a 33-50 s launch (measured 2026-11-29, AMD EPYC, the ``workers`` group's seconds in a rank's results)."""
PRELOAD = ["__main__", "torch", "unified_dist"]


# ---------------------------------------------------------------------- data and model
def table(n):
    """Row i: (x_i, y_i) from a fixed generator; the same on every rank and in the plain reference."""
    g = torch.Generator().manual_seed(99)
    return torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randn(n, 1, generator=g, dtype=torch.float64)


X, Y = table(128)


class Rows(IterableDataset):
    """A stream of rows ``ids`` (no ``__len__``, no ``__getitem__``): yields (x, y, id)."""

    def __init__(self, ids):
        self.ids = list(ids)

    def __iter__(self):
        for i in self.ids:
            yield X[i], Y[i], i


class WorkerAware(Rows):
    """Splits itself between DataLoader workers with ``get_worker_info``, as torch's docs show."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, me = (1, 0) if info is None else (info.num_workers, info.id)
        for k, i in enumerate(self.ids):
            if k % workers == me:
                yield X[i], Y[i], i


class Sharded(IterableDataset):
    """A dataset that declares shards: ``n_shards`` and ``shard(num_shards, index)`` (shards ``index``,
    ``index + num_shards``, ...); iterated whole it yields its shards one after another."""

    def __init__(self, shards):
        self.shards = [list(s) for s in shards]
        self.n_shards = len(self.shards)

    def shard(self, num_shards, index):
        return Sharded(self.shards[index::num_shards])

    def __iter__(self):
        for part in self.shards:
            for i in part:
                yield X[i % len(X)], Y[i % len(Y)], i


class ByRank(IterableDataset):
    """A stream that differs between ranks (sharded by rank by hand): must be refused."""

    def __iter__(self):
        for i in range(10):
            yield X[i + ud.rank()], Y[i + ud.rank()], i + ud.rank()


def net():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def mse(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def shards(ids, parts):
    """Split ``ids`` into consecutive pieces of sizes ``parts``."""
    out, start = [], 0
    for n in parts:
        out.append(ids[start:start + n])
        start += n
    return out


def step_rows(pieces, per_rank, world, start=0):
    """The rows of each step of a dataset with shards ``pieces`` read by shards, as ``gather_for_metrics``
    returns them: slot p is row p // n of shard p % n (none past the shard's end), rank r holds the slots
    p = r (mod world), a step is the next per_rank x world slots from ``start`` (rank 0's rows, then rank
    1's), and a step without rows is skipped. Under 2 ranks and 2 shards: rank r reads shard r."""
    n, size = len(pieces), per_rank * world
    steps = []
    for t in range(start, n * max(map(len, pieces)), size):
        rows = [pieces[p % n][p // n] for r in range(world) for p in range(t, t + size)
                if p % world == r and p // n < len(pieces[p % n])]
        if rows:
            steps.append(rows)
    return steps


def split_counts(m, world):
    """A global batch of m split as evenly as it goes, lower ranks taking the extra rows."""
    return [m // world + (1 if r < m % world else 0) for r in range(world)]


def params(model):
    return torch.cat([p.detach().cpu().reshape(-1) for p in ud.unwrap(model).parameters()])


def plain_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def ids_of(batch):
    return [int(i) for i in batch[2].tolist()]


# ---------------------------------------------------------------------- the checks
CHECKS = {}
"""Each group's checks (its method name -> the check names it reports), in the order they run."""


def reports(*names):
    def register(fn):
        CHECKS[fn.__name__] = names
        return fn
    return register


class Checks:
    def __init__(self, out, tag, csv_one, csv_two, resume_from, resume_split_from):
        self.out, self.tag = out, tag
        self.csv_one, self.csv_two = csv_one, csv_two
        self.resume_from, self.resume_split_from = resume_from, resume_split_from
        self.results, self.measured = {}, {}
        self.rank, self.world = ud.rank(), ud.world_size()

    def attempt(self, name, fn):
        try:
            fn()
            self.results[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported per check, asserted by the test
            self.results[name] = "FAIL: " + "".join(traceback.format_exception_only(type(exc), exc)).strip() \
                + "\n" + traceback.format_exc()[-1500:]

    def run(self, group):
        """The group's collectives, then its assertions (check name -> function); an error in the
        collectives' part fails every check of the group."""
        started = time.perf_counter()
        try:
            asserts = getattr(self, group)()
        except Exception as exc:  # noqa: BLE001
            text = "FAIL: " + "".join(traceback.format_exception_only(type(exc), exc)).strip() \
                + "\n" + traceback.format_exc()[-1500:]
            for check in CHECKS[group]:
                self.results[check] = text
            return
        self.measured.setdefault("group_s", {})[group] = round(time.perf_counter() - started, 2)
        assert sorted(asserts) == sorted(CHECKS[group]), (group, sorted(asserts))
        for check in CHECKS[group]:
            self.attempt(check, asserts[check])

    # 1 ------------------------------------------------------------------
    @reports("each_row_once_per_epoch_and_step_batches_are_one_processs_global_batches",
             "adamw_over_two_epochs_with_a_ragged_last_batch_equals_one_process")
    def rows_and_training(self):
        world, B = self.world, PER_RANK * self.world
        model = net()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        loader = DataLoader(Rows(range(ROWS)), batch_size=PER_RANK)
        model, opt, loader = ud.prepare(model, opt, loader)
        seen = []
        for _ in range(EPOCHS):
            steps = []
            for batch in loader:
                ud.backward(mse(model, batch[0], batch[1]))
                opt.step()
                opt.zero_grad()
                steps.append(ids_of(batch))
            seen.append(steps)
        everyone = ud.all_gather_object(seen)
        mine = params(model)
        every = ud.all_gather_object(mine)

        reference = net()
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
        for _ in range(EPOCHS):
            for s in range(0, ROWS, B):
                idx = list(range(s, min(s + B, ROWS)))
                mse(reference, X[idx], Y[idx]).backward()
                ref_opt.step()
                ref_opt.zero_grad()

        def rows():
            n_steps = -(-ROWS // B)
            for epoch in range(EPOCHS):
                assert all(len(everyone[r][epoch]) == n_steps for r in range(world)), \
                    ("steps per rank", epoch, [len(everyone[r][epoch]) for r in range(world)], n_steps)
                for s in range(n_steps):
                    want = list(range(s * B, min((s + 1) * B, ROWS)))
                    got = [i for r in range(world) for i in everyone[r][epoch][s]]
                    assert got == want, (epoch, s, got, want)
                    sizes = [len(everyone[r][epoch][s]) for r in range(world)]
                    assert sizes == split_counts(len(want), world), (epoch, s, sizes)
                union = sorted(i for r in range(world) for step in everyone[r][epoch] for i in step)
                assert union == list(range(ROWS)), (epoch, union)

        def training():
            expected = plain_params(reference)
            err = (mine - expected).abs().max().item()
            assert err <= 1e-6, f"parameters differ from one process by {err:.3g}"
            assert all(torch.equal(p, mine) for p in every), "ranks hold different parameters"
        return dict(zip(CHECKS["rows_and_training"], (rows, training)))

    # 2 ------------------------------------------------------------------
    @reports("gather_for_metrics_over_an_iterable_eval_set_returns_37_rows_in_order")
    def eval_gather(self):
        plain = net()
        model = ud.prepare(net())
        loader = ud.prepare(DataLoader(Rows(range(EVAL_ROWS)), batch_size=EVAL_PER_RANK))
        ids, preds = [], []
        with torch.no_grad():
            for batch in loader:
                ids.append(ud.gather_for_metrics(batch[2]))
                preds.append(ud.gather_for_metrics(model(batch[0])))
        ids = torch.cat(ids).tolist()
        preds = torch.cat(preds)

        def gathered():
            assert ids == list(range(EVAL_ROWS)), ids
            with torch.no_grad():
                want = plain(X[:EVAL_ROWS])
            assert preds.shape == want.shape, (preds.shape, want.shape)
            assert (preds.cpu() - want).abs().max().item() <= 1e-12
        return dict(zip(CHECKS["eval_gather"], (gathered,)))

    # 3 ------------------------------------------------------------------
    @reports("a_datasets_streaming_csv_gives_each_row_once_in_global_batches",
             "two_csv_files_split_by_rank_give_each_row_once_and_end_at_the_same_step")
    def csv(self):
        import datasets

        world, B = self.world, PER_RANK * self.world

        def read(paths):
            data = datasets.load_dataset("csv", data_files=paths, streaming=True, split="train")
            loader = ud.prepare(DataLoader(data, batch_size=PER_RANK))
            local, gathered = [], []
            for batch in loader:
                local.append([int(i) for i in batch["id"].tolist()])
                gathered.append([int(i) for i in ud.gather_for_metrics(batch["id"]).tolist()])
            return data.n_shards, ud.all_gather_object(local), gathered

        def file_ids(path):
            with open(path) as f:
                return [int(line.split(",")[0]) for line in f.read().split("\n")[1:] if line]

        one = [file_ids(p) for p in self.csv_one]
        two = [file_ids(p) for p in self.csv_two]
        shards_one, local_one, gathered_one = read(self.csv_one)
        shards_two, local_two, gathered_two = read(self.csv_two)

        def one_shard():
            rows = one[0]
            assert shards_one == 1, shards_one
            steps = [rows[s:s + B] for s in range(0, len(rows), B)]
            assert [len(local_one[r]) for r in range(world)] == [len(steps)] * world, local_one
            for s, want in enumerate(steps):
                got = [i for r in range(world) for i in local_one[r][s]]
                assert got == want, (s, got, want)
            assert gathered_one == steps, gathered_one

        def two_shards():
            assert shards_two == 2, shards_two
            if world == 2:  # split: rank r reads file r; step s is rank 0's s-th batch, then rank 1's
                n_steps = max(-(-len(ids) // PER_RANK) for ids in two)
                assert [len(local_two[r]) for r in range(world)] == [n_steps] * world, \
                    f"steps per rank {[len(x) for x in local_two]}, expected {n_steps} on every rank"
                for r in range(world):  # a rank whose file ran out gets one padding row a step
                    mine = [two[r][s * PER_RANK:(s + 1) * PER_RANK] for s in range(-(-len(two[r]) // PER_RANK))]
                    assert local_two[r][:len(mine)] == mine, (r, local_two[r], mine)
                    assert all(len(b) == 1 for b in local_two[r][len(mine):]), (r, local_two[r])
            want = step_rows(two, PER_RANK, world)  # one process too reads the files interleaved
            assert gathered_two == want, (gathered_two, want)
            assert sorted(i for step in gathered_two for i in step) == sorted(two[0] + two[1])
        return dict(zip(CHECKS["csv"], (one_shard, two_shards)))

    # 4 ------------------------------------------------------------------
    @reports("num_workers_2_duplicates_nothing_and_gives_the_batches_of_num_workers_0",
             "num_workers_2_split_by_shards_duplicates_nothing")
    def workers(self):
        world = self.world
        got = {}
        for name, cls in (("plain", Rows), ("worker_aware", WorkerAware)):
            for workers in (0, 2):
                loader = ud.prepare(DataLoader(cls(range(WORKER_ROWS)), batch_size=PER_RANK, num_workers=workers,
                                               multiprocessing_context=WORKER_START if workers else None))
                got[(name, workers)] = ud.all_gather_object([ids_of(b) for b in loader])
        parts = shards(list(range(sum(SPLIT_SHARDS))), SPLIT_SHARDS)
        split = ud.prepare(DataLoader(Sharded(parts), batch_size=PER_RANK, num_workers=2,
                                      multiprocessing_context=WORKER_START))
        split_steps = [ud.gather_for_metrics(b[2]).tolist() for b in split]
        split_counts_ = ud.all_gather_object(len(split_steps))

        def same():
            B = PER_RANK * world
            want = [list(range(s, min(s + B, WORKER_ROWS))) for s in range(0, WORKER_ROWS, B)]
            for (name, workers), everyone in got.items():
                steps = [[i for r in range(world) for i in everyone[r][s]] for s in range(len(everyone[0]))]
                assert steps == want, (name, workers, steps)
                assert everyone == got[(name, 0)], (name, workers, everyone, got[(name, 0)])
        def split_same():
            want = step_rows(parts, PER_RANK, world)
            assert split_counts_ == [len(want)] * world, split_counts_
            assert split_steps == want, (split_steps, want)
        return dict(zip(CHECKS["workers"], (same, split_same)))

    # 5 ------------------------------------------------------------------
    @reports("streams_of_0_and_1_rows_end_cleanly_on_every_rank",
             "one_row_trains_with_the_padding_row_weighted_0")
    def tiny(self):
        world = self.world
        # 0 rows: no step anywhere, and the next collective is reached by every rank
        empty = ud.prepare(DataLoader(Rows([]), batch_size=PER_RANK))
        steps_empty = ud.all_gather_object(sum(1 for _ in empty))
        # 1 row: one step; ranks without the row get a padding row weighted 0. The gradient is read from
        # what an SGD step with lr 1 subtracts (Horovod averages gradients in the optimizer's step)
        model = net()
        start = plain_params(model)
        model, opt, loader = ud.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                        DataLoader(Rows([5]), batch_size=PER_RANK))
        steps, gathered = 0, []
        for batch in loader:
            steps += 1
            gathered.append(ud.gather_for_metrics(batch[2]).tolist())
            ud.backward(mse(model, batch[0], batch[1]))
            opt.step()
            opt.zero_grad()
        grads = start - params(model)
        steps_one = ud.all_gather_object(steps)
        plain = net()
        mse(plain, X[[5]], Y[[5]]).backward()
        want = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])

        def ends():
            assert steps_empty == [0] * world, steps_empty
            assert steps_one == [1] * world, steps_one
            assert gathered == [[5]], gathered

        def gradient():
            err = (grads - want).abs().max().item()
            assert err <= 1e-12, f"gradient differs from one process on the row by {err:.3g}"
        return dict(zip(CHECKS["tiny"], (ends, gradient)))

    # 6 ------------------------------------------------------------------
    @reports("a_seeded_shuffle_buffer_gives_each_row_once_and_a_new_order_each_epoch")
    def shuffle(self):
        world = self.world
        ud.seed_everything(SEED)
        loader = ud.prepare(DataLoader(ud.stream(Rows(range(ROWS)), shuffle_buffer=BUFFER), batch_size=PER_RANK))
        orders, steps = [], []
        for _ in range(EPOCHS):
            batches = [ud.gather_for_metrics(b[2]).tolist() for b in loader]
            orders.append([i for b in batches for i in b])
            steps.append(ud.all_gather_object(len(batches)))
        self.measured["shuffled_orders"] = orders

        def shuffled():
            for order, counts in zip(orders, steps):
                assert sorted(order) == list(range(ROWS)), order
                assert counts == [-(-ROWS // (PER_RANK * world))] * world, counts
            assert orders[0] != list(range(ROWS)), "not shuffled"
            assert orders[1] != orders[0], "the second epoch repeats the first's order"
        return dict(zip(CHECKS["shuffle"], (shuffled,)))

    # 7 ------------------------------------------------------------------
    @reports("split_by_shards_each_row_once_every_rank_ends_at_the_same_step",
             "split_by_shards_training_equals_one_process_on_the_step_batches",
             "split_by_shards_past_two_exchanges_of_counts_gathers_each_row_once")
    def split(self):
        world = self.world
        parts = shards(list(range(sum(SPLIT_SHARDS))), SPLIT_SHARDS)
        model = net()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        loader = DataLoader(Sharded(parts), batch_size=PER_RANK)
        model, opt, loader = ud.prepare(model, opt, loader)
        local, gathered = [], []
        for batch in loader:
            ud.backward(mse(model, batch[0], batch[1]))
            opt.step()
            opt.zero_grad()
            local.append(ids_of(batch))
            gathered.append(ud.gather_for_metrics(batch[2]).tolist())
        everyone = ud.all_gather_object(local)
        mine = params(model)
        long_parts = shards(list(range(sum(LONG_SHARDS))), LONG_SHARDS)
        long_loader = ud.prepare(DataLoader(Sharded(long_parts), batch_size=1))
        long_gathered = [ud.gather_for_metrics(b[2]).tolist() for b in long_loader]
        long_steps = ud.all_gather_object(len(long_gathered))

        want = step_rows(parts, PER_RANK, world)
        reference = net()
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
        for idx in want:
            mse(reference, X[idx], Y[idx]).backward()
            ref_opt.step()
            ref_opt.zero_grad()

        def rows():
            assert [len(x) for x in everyone] == [len(want)] * world, \
                f"steps per rank {[len(x) for x in everyone]}, expected {len(want)} on every rank"
            assert gathered == want, (gathered, want)
            if world == 2:
                for r in range(world):
                    for s, batch in enumerate(everyone[r]):
                        real = parts[r][s * PER_RANK:(s + 1) * PER_RANK]
                        assert batch == real or (not real and len(batch) == 1), (r, s, batch, real)

        def training():
            err = (mine - plain_params(reference)).abs().max().item()
            assert err <= 1e-6, f"parameters differ from one process on the step batches by {err:.3g}"

        def long():
            expect = step_rows(long_parts, 1, world)
            assert long_steps == [len(expect)] * world, (long_steps, len(expect))
            assert long_gathered == expect, (long_gathered, expect)
        return dict(zip(CHECKS["split"], (rows, training, long)))

    # 8 ------------------------------------------------------------------
    @reports("a_stream_that_differs_between_ranks_is_refused_on_every_rank")
    def differing(self):
        loader = ud.prepare(DataLoader(ByRank(), batch_size=PER_RANK))
        outcome = None
        try:
            outcome = sum(len(ids_of(b)) for b in loader)
        except ud.UnifiedDistError as exc:
            outcome = str(exc)

        def refused():
            if self.world == 1:  # one process: nothing to compare with, the stream is read
                assert outcome == 10, outcome
                return
            assert isinstance(outcome, str), f"not refused: this rank read {outcome} rows"
            assert "the stream differs between ranks" in outcome and "\n" not in outcome, outcome
        return dict(zip(CHECKS["differing"], (refused,)))

    # 9 ------------------------------------------------------------------
    @reports("a_mid_epoch_state_dict_leaves_the_pass_going_on")
    def resume_save(self):
        """Epoch 0 whole, then epoch 1 with a state taken after RESUME_STEPS steps; the uninterrupted run's
        order goes beside the state. A by-shards state (the 2-shard dataset) too."""
        world = self.world
        ud.seed_everything(SEED)
        loader = ud.prepare(DataLoader(ud.stream(Rows(range(ROWS)), shuffle_buffer=BUFFER), batch_size=PER_RANK))
        for _ in loader:
            pass
        state, order = None, []
        for s, batch in enumerate(loader):
            order += ud.gather_for_metrics(batch[2]).tolist()
            if s + 1 == RESUME_STEPS:
                state = loader.state_dict()
        consumed = RESUME_STEPS * PER_RANK * world
        # the 2-shard dataset, read by shards (under 1 rank too): states of the canonical order
        split_loader = ud.prepare(DataLoader(Sharded(shards(list(range(43)), SPLIT_SHARDS)), batch_size=PER_RANK))
        split_states, split_rows = {}, []
        for s, batch in enumerate(split_loader):
            split_rows.append(ud.gather_for_metrics(batch[2]).tolist())
            if s + 1 in SPLIT_RESUME_STEPS:
                split_states[s + 1] = split_loader.state_dict()
        split_rests = {k: [i for step in split_rows[k:] for i in step] for k in SPLIT_RESUME_STEPS}
        if self.rank == 0:
            with open(os.path.join(self.out, f"{self.tag}_resume.json"), "w") as f:
                json.dump({"world_size": world, "state": state, "rest": order[consumed:],
                           "split_states": split_states, "split_rests": split_rests}, f)
        ud.barrier()

        def saved():
            assert state is not None and sorted(split_states) == list(SPLIT_RESUME_STEPS), (state, split_states)
            assert sorted(order) == list(range(ROWS)), order
        return dict(zip(CHECKS["resume_save"], (saved,)))

    @reports("a_mid_epoch_state_resumes_at_another_world_size_with_the_uninterrupted_rows",
             "a_shards_state_resumes_at_another_world_size_in_the_canonical_order",
             "a_shards_state_read_whole_is_refused_in_one_line")
    def resume_load(self):
        world = self.world
        with open(os.path.join(self.out, f"{self.resume_from}_resume.json")) as f:
            saved = json.load(f)
        loader = ud.prepare(DataLoader(ud.stream(Rows(range(ROWS)), shuffle_buffer=BUFFER), batch_size=PER_RANK))
        loader.load_state_dict(saved["state"])
        # gather_for_metrics: the remainder's last global batch may hold fewer rows than ranks (padding)
        got = [i for b in loader for i in ud.gather_for_metrics(b[2]).tolist()]
        nxt = [i for b in loader for i in ud.gather_for_metrics(b[2]).tolist()]
        # the 2-shard dataset is read by shards under 1 and 2 ranks: its state resumes at either
        parts = shards(list(range(43)), SPLIT_SHARDS)
        state = saved["split_states"][str(SPLIT_RESUME_STEPS[0])]
        shards_loader = ud.prepare(DataLoader(Sharded(parts), batch_size=PER_RANK))
        shards_loader.load_state_dict(state)
        shards_rows = [ud.gather_for_metrics(b[2]).tolist() for b in shards_loader]
        whole_loader = ud.prepare(DataLoader(ud.stream(Sharded(parts), split=False), batch_size=PER_RANK))
        whole_loader.load_state_dict(state)
        try:
            refusal = f"read {sum(1 for _ in whole_loader)} batches"
        except ud.UnifiedDistError as exc:
            refusal = exc
        reported = ud.all_gather_object(type(refusal).__name__)

        def continues():
            assert saved["world_size"] != world, ("resume across world sizes", saved["world_size"], world)
            assert got == saved["rest"], (got, saved["rest"])
            assert sorted(nxt) == list(range(ROWS)), ("the next epoch", nxt)

        def canonical():
            start = SPLIT_RESUME_STEPS[0] * PER_RANK * saved["world_size"]  # slots the saving launch consumed
            assert shards_rows == step_rows(parts, PER_RANK, world, start), (shards_rows, start)

        def refused():
            assert isinstance(refusal, ud.UnifiedDistError), refusal
            text = str(refusal)
            assert "\n" not in text and "split=False" in text, text
            assert reported == ["UnifiedDistError"] * world, reported
        return dict(zip(CHECKS["resume_load"], (continues, canonical, refused)))

    @reports("a_split_state_resumes_at_the_same_world_size_with_the_uninterrupted_rows",
             "a_split_state_taken_after_a_ranks_shards_ran_out_resumes_with_the_uninterrupted_rows")
    def resume_split(self):
        """A split state another launch with as many ranks saved (after 3 steps, and after 5: rank 1's shard
        of 13 rows ran out after 4) continues with the rows that launch went on with."""
        with open(os.path.join(self.out, f"{self.resume_split_from}_resume.json")) as f:
            saved = json.load(f)
        outcomes = {}
        for k in SPLIT_RESUME_STEPS:
            loader = ud.prepare(DataLoader(Sharded(shards(list(range(43)), SPLIT_SHARDS)), batch_size=PER_RANK))
            loader.load_state_dict(saved["split_states"][str(k)])
            try:  # an error here comes after the same exchange of counts on every rank: no rank is left waiting
                outcomes[k] = [i for b in loader for i in ud.gather_for_metrics(b[2]).tolist()]
            except ud.UnifiedDistError as exc:
                outcomes[k] = exc

        def resumes(k):
            def check():
                assert saved["world_size"] == self.world, (saved["world_size"], self.world)
                got = outcomes[k]
                assert not isinstance(got, Exception), f"refused: {got}"
                assert got == saved["split_rests"][str(k)], (got, saved["split_rests"][str(k)])
            return check
        return dict(zip(CHECKS["resume_split"], [resumes(k) for k in SPLIT_RESUME_STEPS]))

    # issue 46 (items 2, 3, 9) ---------------------------------------------
    @reports("a_datasets_stream_split_by_node_already_is_refused_in_one_line",
             "a_stream_that_diverges_late_is_refused_on_every_rank_before_a_diverged_step",
             "a_stream_that_ends_earlier_on_one_rank_is_refused_not_a_hang",
             "split_true_in_one_process_reads_every_shard")
    def issue46(self):
        import datasets
        from datasets.distributed import split_dataset_by_node

        rank, world = self.rank, self.world
        odd = world > 1 and rank == world - 1  # the rank whose stream differs (none in one process)
        data = datasets.load_dataset("csv", data_files=self.csv_two, streaming=True, split="train")
        try:  # the DDP habit: split by node, then prepare (which splits again)
            ud.prepare(DataLoader(split_dataset_by_node(data, rank, world), batch_size=PER_RANK))
            by_node = "not refused"
        except ud.UnifiedDistError as exc:
            by_node = str(exc)
        # the odd rank drops row 90 (global batch 11 of 8 rows under 2 ranks), trained on until refused
        model = net()
        model, opt, loader = ud.prepare(model, torch.optim.SGD(model.parameters(), lr=LR), DataLoader(
            Rows(i for i in range(ROWS) if not (odd and i == LATE_ROW)), batch_size=PER_RANK))
        late = until_refused(loader, model, opt)
        # the odd rank's stream ends after row 71 (9 global batches), the others' goes on: read, not trained
        ends = until_refused(ud.prepare(DataLoader(Rows(range(72 if odd else ROWS)), batch_size=PER_RANK)))
        parts = shards(list(range(sum(SPLIT_SHARDS))), SPLIT_SHARDS)
        split = ud.prepare(DataLoader(ud.stream(Sharded(parts), split=True), batch_size=PER_RANK))
        split_steps = [ud.gather_for_metrics(b[2]).tolist() for b in split]
        steps = -(-ROWS // (PER_RANK * world))

        def split_by_node():
            assert by_node == (
                f"prepare() got a datasets stream already split by split_dataset_by_node (rank {rank} of {world}), "
                "which prepare() would split again, losing data; drop the split_dataset_by_node call and pass the "
                "whole stream: prepare() gives each rank its part"), by_node

        def refused(outcome, start):
            if world == 1:
                assert outcome == (steps, None), outcome
                return
            assert outcome[0] == 8 and outcome[1] is not None and "\n" not in outcome[1], outcome
            assert outcome[1].startswith(start), outcome[1]

        def split_true():
            assert split_steps == step_rows(parts, PER_RANK, world), (split_steps, step_rows(parts, PER_RANK, world))
        return dict(zip(CHECKS["issue46"], (
            split_by_node,
            lambda: refused(late, "the stream differs between ranks (global batches 8-16 have fingerprints ["),
            lambda: refused(ends, "the stream differs between ranks (it ends after 9 global batches on rank 1 and "
                                  "goes on on rank 0): "),
            split_true)))


LATE_ROW = 90  # issue 46: a row one rank drops, past the first comparison of global batches (0-8)


def until_refused(loader, model=None, opt=None):
    """(steps taken, the error that ended the pass or None); a training step each when a model is given."""
    taken = 0
    try:
        for batch in loader:
            if model is not None:
                ud.backward(mse(model, batch[0], batch[1]))
                opt.step()
                opt.zero_grad()
            taken += 1
    except ud.UnifiedDistError as exc:
        return taken, str(exc)
    return taken, None


SUITE = ("rows_and_training", "eval_gather", "csv", "workers", "tiny", "shuffle", "split", "differing",
         "resume_save", "issue46")


def run_all(out, tag, csv_one, csv_two, resume_from, resume_split_from, only, json_eight=()):
    import multiprocessing

    multiprocessing.set_forkserver_preload(PRELOAD)  # before the rank's first DataLoader worker starts it
    ud.init()
    checks = Checks(out, tag, csv_one, csv_two, resume_from, resume_split_from)
    checks.json_eight = list(json_eight)
    for group in {"resume": (), "order": ("order",)}.get(only, SUITE):
        checks.run(group)
    if resume_from:
        checks.run("resume_load")
    if resume_split_from:
        checks.run("resume_split")
    identity = {"backend": ud.backend_name(), "launcher": ud.launcher(), "world_size": ud.world_size(),
                "rank": ud.rank()}
    ud.barrier()
    with open(os.path.join(out, f"{tag}_rank{identity['rank']}.json"), "w") as f:
        json.dump({"identity": identity, "results": checks.results, "measured": checks.measured}, f)
    ud.shutdown()


def main():
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("STREAM_DUMP_AFTER", "170")), exit=True)
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--csv-one", default="", help="one CSV file (comma-separated paths)")
    parser.add_argument("--csv-two", default="", help="two CSV files, comma-separated")
    parser.add_argument("--resume-from", default=None, help="load the loader state a launch with this tag wrote")
    parser.add_argument("--resume-split-from", default=None,
                        help="load the split-mode states a launch with this tag (and as many ranks) wrote")
    parser.add_argument("--only", choices=["resume", "order"], default=None)
    parser.add_argument("--json-eight", default="", help="8 JSON files, comma-separated (the order checks)")
    parser.add_argument("--ud-launch", type=int, default=0, metavar="N", help="run the checks in N ud.launch workers")
    args = parser.parse_args()
    call = (args.out, args.tag, [p for p in args.csv_one.split(",") if p], [p for p in args.csv_two.split(",") if p],
            args.resume_from, args.resume_split_from, args.only, [p for p in args.json_eight.split(",") if p])
    if args.ud_launch:  # the checks by reference to this module (not __main__), as a notebook imports its code:
        # the DataLoader workers of a spawn-ed ud.launch worker are spawn-ed too and unpickle the datasets by name
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import stream_worker

        ud.launch(stream_worker.run_all, *call, nproc=args.ud_launch, backend="torch")
    else:
        run_all(*call)


# ---------------------------------------------------------------------- issue 46 item 7: one order at 1, 2, 4 ranks
ORDER_GLOBAL, ORDER_EPOCHS, ORDER_LR, ORDER_BUFFER = 8, 2, 0.1, 16
"""8 JSON files (tests/launchers/test_streams_under_launchers.py writes them) packed into blocks of 2 rows per file, in
global batches of 8 blocks: per rank 8 under 1 process, 4 under 2, 2 under 4 (the launch with ``--only order``)."""
ORDER_REL_TOL = 1e-12
"""The order check trains in float64 (blocks and model): its 6 SGD steps (20 blocks a epoch in global batches of
8, 2 epochs, lr 0.1) sum each gradient over the ranks' rows in another order than one process, each sum (<= 8
blocks, widths <= 8) moving by at most 8 * 2**-53 ~ 1e-15 of its terms' magnitudes, and each step carries an earlier
difference on by a factor 1 + lr * L (L, the loss's curvature, a few): losses (O(1)) agree to ~1e-14 at worst
relative; measured 1.16e-7 in float32 (AMD EPYC, 2026-11-28) against the former bound 1e-6, hence float64. A step
on other blocks, or a block counted twice, moves the next loss by ~lr x its gradient, O(1e-2) relative."""


class PackedRows(IterableDataset):
    """A ``datasets`` stream packed into blocks of 2 consecutive rows (an odd row left at the end is
    dropped), as a tokenising stream packs tokens into blocks; splits itself with its stream's shards."""

    def __init__(self, data):
        self.data = data
        self.n_shards = data.n_shards

    def shard(self, num_shards, index):
        return PackedRows(self.data.shard(num_shards=num_shards, index=index))

    def __iter__(self):
        rows = iter(self.data)
        for a in rows:
            b = next(rows, None)
            if b is None:
                return
            yield block(int(a["id"]), int(b["id"]))


def block(a, b):
    """Block (a, b): x the two rows' x side by side (float64, as X), y their sum, id a * 1000 + b."""
    return torch.cat([X[a], X[b]]), Y[a] + Y[b], a * 1000 + b


def order_net():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


class Opens:
    """Which of ``paths`` this process opens (a ``sys.addaudithook`` hook sees every ``open``)."""

    def __init__(self, paths):
        self.paths = {os.path.realpath(p) for p in paths}
        self.seen = []
        sys.addaudithook(self.hook)

    def hook(self, event, args):
        if event == "open" and isinstance(args[0], str) and os.path.realpath(args[0]) in self.paths:
            self.seen.append(os.path.realpath(args[0]))


@reports("shards_train_on_one_order_at_every_world_size_equal_to_single_process_torch_on_its_steps",
         "each_rank_opens_only_its_shards_once_per_epoch")
def order(self):
    import datasets

    world, files = self.world, self.json_eight
    opens = Opens(files)
    data = datasets.load_dataset("json", data_files=files, streaming=True, split="train")
    ud.seed_everything(SEED)
    model = order_net()
    opt = torch.optim.SGD(model.parameters(), lr=ORDER_LR)
    model, opt, loader = ud.prepare(model, opt, DataLoader(ud.stream(PackedRows(data), shuffle_buffer=ORDER_BUFFER),
                                                           batch_size=ORDER_GLOBAL // world))
    losses, steps, opened = [], [], []
    for _ in range(ORDER_EPOCHS):
        del opens.seen[:]
        for batch in loader:
            errors = (model(batch[0]) - batch[1]).pow(2).reshape(-1)
            losses.append(ud.gather_for_metrics(errors.detach()).double().mean().item())
            steps.append(ud.gather_for_metrics(batch[2]).tolist())
            ud.backward(errors.mean())
            opt.step()
            opt.zero_grad()
        opened.append(list(opens.seen))
    opened = ud.all_gather_object(opened)  # [rank][epoch] -> the files opened
    self.measured["order"] = {"losses": losses, "steps": [sorted(s) for s in steps]}
    self.measured["order_bytes"] = [[sum(os.path.getsize(p) for p in opened[r][e]) for r in range(world)]
                                    for e in range(ORDER_EPOCHS)]  # [epoch][rank]

    reference = order_net()  # single-process torch on the steps' blocks
    ref_opt = torch.optim.SGD(reference.parameters(), lr=ORDER_LR)
    ref_losses = []
    for ids in steps:
        x = torch.stack([block(i // 1000, i % 1000)[0] for i in ids])
        y = torch.stack([block(i // 1000, i % 1000)[1] for i in ids])
        loss = torch.nn.functional.mse_loss(reference(x), y)
        ref_losses.append(loss.item())
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

    def file_blocks(path):
        with open(path) as f:
            ids = [json.loads(line)["id"] for line in f if line.strip()]
        return [ids[k] * 1000 + ids[k + 1] for k in range(0, len(ids) - 1, 2)]

    def trains():
        blocks = sorted(b for path in files for b in file_blocks(path))  # packed per file, at every world size
        half = len(steps) // 2
        assert [sorted(i for s in steps[:half] for i in s), sorted(i for s in steps[half:] for i in s)] \
            == [blocks, blocks], steps
        assert [sorted(s) for s in steps[:half]] != [sorted(s) for s in steps[half:]], "an epoch's steps repeat"
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        assert len(losses) == len(ref_losses) and rel <= ORDER_REL_TOL, \
            f"losses differ from single-process torch by {rel:.3g}"

    def reads_own():
        for epoch in range(ORDER_EPOCHS):
            per_rank = [opened[r][epoch] for r in range(world)]
            assert all(len(o) == len(set(o)) == len(files) // world for o in per_rank), per_rank
            assert sorted(p for o in per_rank for p in o) == sorted(os.path.realpath(p) for p in files), per_rank
    return dict(zip(CHECKS["order"], (trains, reads_own)))


Checks.order = order
SUITE = SUITE + ("order",)


if __name__ == "__main__":
    main()
