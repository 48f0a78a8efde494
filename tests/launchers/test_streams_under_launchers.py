"""Streams through ``ud.prepare`` (issue 27) under every launcher: python (1 process), torchrun, accelerate
launch, horovodrun, a real srun (one-node SLURM), Open MPI's mpirun and ``ud.launch`` (2 processes each).

One launch per launcher runs every check of tests/launchers/workers/stream_worker.py on every rank; each check
is one test item here, asserted per rank. Checks: a 101-row IterableDataset in global batches of
4 x world (each row once per epoch; a model trained two epochs equals one process), an iterable eval
set of 37 rows gathered in order, a ``datasets`` streaming CSV (one file, and two files that split by
rank), ``num_workers=2``, streams of 0 and 1 rows, a seeded shuffle buffer, a generic dataset split by
its shards (uneven), a stream that differs between ranks (refused), issue 46's (a ``datasets`` stream split by
node refused in one line; a stream that diverges late, or ends earlier on one rank, refused at step 8 on every
rank; ``split=True`` in one process reads every shard), and mid-epoch resume across world
sizes: the python launch saves a state mid-epoch that every 2-process launch resumes (1 -> 2), and a
second python launch resumes the torchrun launch's (2 -> 1); the torchrun launch's split-mode states
resume in the other 2-process launches, and in the 1-process ones in the canonical order of the shards
(a state read back whole is refused). The shuffled order is compared across
launches here: it must not depend on the launcher or the world size. Issue 46 item 7: 8 JSON files read by
shards, packed per file and shuffled, train on the same per-step losses under 1, 2 and 4 ranks (a third
torchrun launch, 4 processes, runs only those checks), each rank opening only its files.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, Optional, Tuple

import pytest

from unified_dist.testing.launchers import BIN, ROOT, Result, child_env, launch, run

sys.path.insert(0, str(ROOT / "tests" / "launchers" / "workers"))
import stream_worker  # noqa: E402  (the check names; the checks run in the launched processes)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = "tests/launchers/workers/stream_worker.py"
LAUNCHERS = ("python", "torchrun", "accelerate", "horovodrun", "srun", "mpirun", "ud.launch")
BACKEND = {"python": "single", "accelerate": "accelerate", "horovodrun": "horovod"}  # the others: torch
FIXTURE = {"srun": "slurm_cluster", "mpirun": "mpirun_available"}
TIMEOUT = 200  # a launch takes 10-30 s on 2 cores; the worker dumps its stacks and exits after 170 s
RESUMED = "python-resumed"  # a second, 1-process launch that resumes the torchrun launch's state (2 -> 1)
FOUR = "torchrun-4"  # torchrun with 4 processes, only the order checks (issue 46 item 7)
JSON_EIGHT = (7, 3, 9, 5, 6, 2, 8, 4)  # rows per file: packed in 2s per file, some files end with an odd row
CSV_ONE = [(7 * i + 3) % 23 for i in range(23)]  # ids in an order no sorting gives back
# 2 shards of 9 and 15 rows: under 2 ranks rank 0's runs out first, so its padding rows lie before rank 1's rows
CSV_TWO = ([200 + (4 * i) % 9 for i in range(9)], [100 + (5 * i) % 15 for i in range(15)])


def nproc(launcher: str) -> int:
    return 1 if launcher in ("python", RESUMED) else 4 if launcher == FOUR else 2


def named(launcher: str) -> str:
    """The launcher the processes of this launch report."""
    return {RESUMED: "python", FOUR: "torchrun"}.get(launcher, launcher)


def tag(launcher: str) -> str:
    return launcher.replace(".", "_").replace("-", "_")


def _eight():
    """The 8 files' row ids: distinct rows of the worker's 128-row table, in no sorted order."""
    ids = [(37 * k + 5) % 97 for k in range(sum(JSON_EIGHT))]
    return [ids[sum(JSON_EIGHT[:k]):sum(JSON_EIGHT[:k + 1])] for k in range(len(JSON_EIGHT))]


def _write_json(path: Path, ids) -> str:
    path.write_text("".join(json.dumps({"id": i}) + "\n" for i in ids))
    return str(path)


def _write_csv(path: Path, ids) -> str:
    path.write_text("id,value\n" + "".join(f"{i},{i / 4}\n" for i in ids))
    return str(path)


class Launches:
    """Each launch once per session, by the first item that needs it; the python launch (whose saved
    state the others resume) before every other, the torchrun launch before the resumed python one."""

    def __init__(self, root: Path):
        self.root = root
        self.csv_one = _write_csv(root / "one.csv", CSV_ONE)
        self.csv_two = ",".join(_write_csv(root / f"two_{k}.csv", ids) for k, ids in enumerate(CSV_TWO))
        self.json_eight = ",".join(_write_json(root / f"eight_{k}.json", ids) for k, ids in enumerate(_eight()))
        self._done: Dict[str, Tuple[Result, Dict[int, dict]]] = {}

    def get(self, launcher: str, env: Optional[dict] = None) -> Tuple[Result, Dict[int, dict]]:
        if launcher not in self._done:
            args = ["--out", str(self.root), "--tag", tag(launcher), "--csv-one", self.csv_one,
                    "--csv-two", self.csv_two, "--json-eight", self.json_eight]
            if launcher == FOUR:
                args += ["--only", "order"]
            elif launcher == RESUMED:
                self.get("torchrun")
                args += ["--resume-from", "torchrun", "--only", "resume"]
            elif launcher != "python":
                self.get("python")
                args += ["--resume-from", "python"]
                if launcher != "torchrun":  # split states resume at the world size that saved them
                    self.get("torchrun")
                    args += ["--resume-split-from", "torchrun"]
            if launcher == "ud.launch":
                result = run([str(BIN / "python"), WORKER, *args, "--ud-launch", "2"], TIMEOUT, child_env())
            else:
                result = launch(named(launcher), WORKER, args,
                                nproc=nproc(launcher), timeout=TIMEOUT, env=env)
            files = {r: self.root / f"{tag(launcher)}_rank{r}.json" for r in range(nproc(launcher))}
            self._done[launcher] = (result, {r: json.loads(p.read_text()) for r, p in files.items() if p.exists()})
        return self._done[launcher]


@pytest.fixture(scope="session")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory.mktemp("streams"))


def _ranks(launcher: str, launches: Launches, request) -> Dict[int, dict]:
    env = request.getfixturevalue(FIXTURE[launcher]) if launcher in FIXTURE else None
    result, ranks = launches.get(launcher, env=env or None)
    result.check()
    assert sorted(ranks) == list(range(nproc(launcher))), f"missing rank results:\n{result.output[-3000:]}"
    for r, data in ranks.items():
        assert data["identity"] == {"backend": BACKEND.get(named(launcher), "torch"), "world_size": nproc(launcher),
                                    "launcher": named(launcher), "rank": r}, data["identity"]
    return ranks


RESUME = stream_worker.CHECKS["resume_load"]
CASES = ([(launcher, check) for launcher in LAUNCHERS for group in stream_worker.SUITE
          for check in stream_worker.CHECKS[group]]
         + [(launcher, check) for launcher in LAUNCHERS[1:] for check in RESUME]
         + [(launcher, check) for launcher in LAUNCHERS[2:] for check in stream_worker.CHECKS["resume_split"]]
         + [(FOUR, check) for check in stream_worker.CHECKS["order"]])


@pytest.mark.parametrize("launcher,check", CASES, ids=["-".join(c) for c in CASES])
def test_streams(launcher, check, launches, request):
    for r, data in _ranks(launcher, launches, request).items():
        assert data["results"][check] == "ok", f"rank {r}: {data['results'][check]}"


@pytest.mark.parametrize("check", RESUME)
def test_resume_from_2_ranks_into_1(check, launches, request):
    """The python-resumed launch loads the torchrun launch's mid-epoch state (whole stream, and split)."""
    _ranks("torchrun", launches, request)
    data = _ranks(RESUMED, launches, request)[0]
    assert data["results"][check] == "ok", data["results"][check]


@pytest.mark.parametrize("launcher", LAUNCHERS[1:])
def test_shuffled_order_is_the_one_process_order(launcher, launches, request):
    """ud.stream(shuffle_buffer=16) after seed_everything: the global order of both epochs under 2 ranks
    is the 1-process launch's (each rank's is checked inside the launch)."""
    one = _ranks("python", launches, request)[0]["measured"]["shuffled_orders"]
    for r, data in _ranks(launcher, launches, request).items():
        assert data["measured"]["shuffled_orders"] == one, f"rank {r}"


# ---------------------------------------------------------------------- issue 46 item 7: one order at 1, 2, 4 ranks
def test_shards_give_the_same_per_step_losses_under_1_2_and_4_ranks(launches, request):
    """8 files read by shards (each rank only its own), packed per file, shuffled: the per-step losses of the
    1-process launch, torchrun x 2 and torchrun x 4 agree to float64 rounding (stream_worker.ORDER_REL_TOL says
    why 1e-12 relative), on the same blocks per step."""
    one = _ranks("python", launches, request)[0]["measured"]["order"]
    for launcher in ("torchrun", FOUR):
        for r, data in _ranks(launcher, launches, request).items():
            got = data["measured"]["order"]
            assert got["steps"] == one["steps"], (launcher, r)
            rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], one["losses"]))
            assert len(got["losses"]) == len(one["losses"]) and rel <= stream_worker.ORDER_REL_TOL, (launcher, r, rel)
        read = [data["measured"]["order_bytes"] for data in _ranks(launcher, launches, request).values()]
        total = _ranks("python", launches, request)[0]["measured"]["order_bytes"][0][0]
        assert all(sum(epoch) == total for epoch in read[0]), (launcher, read, total)  # bytes per rank, each epoch
