"""The facade's contract, checked inside real launchers: python, torchrun, accelerate launch, horovodrun.

Each (launcher, suite) pair is launched once with 2 processes (1 for plain python); every
check in tests/workers/contract_worker.py becomes one test item here, asserted on every rank.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from launchers import BACKEND_OF, LAUNCHERS, ROOT, launch

sys.path.insert(0, str(ROOT / "tests" / "workers"))
import contract_worker  # noqa: E402  (the check list; the checks run in the launched processes)

WORKER = "tests/workers/contract_worker.py"
NPROC = {"python": 1, "torchrun": 2, "accelerate": 2, "horovodrun": 2}
_cache: dict = {}


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
    """One directory for all launchers, so each loads the checkpoints the others wrote."""
    return tmp_path_factory.mktemp("contract")


def _run(launcher: str, suite: str, out: Path) -> dict:
    key = (launcher, suite)
    if key not in _cache:
        result = launch(launcher, WORKER, ["--suite", suite, "--out", str(out)], nproc=NPROC[launcher],
                        timeout=240)
        ranks = {}
        for r in range(NPROC[launcher]):
            path = out / f"{suite}_rank{r}.json"
            if path.exists():
                ranks[r] = json.loads(path.read_text())
                path.rename(out / f"{launcher}_{suite}_rank{r}.json")
        _cache[key] = (result, ranks)
    return _cache[key]


CASES = [(launcher, suite, fn.__name__)
         for launcher in LAUNCHERS for suite, fns in contract_worker.CHECKS.items() for fn in fns]


@pytest.mark.parametrize("launcher,suite,check", CASES, ids=["-".join(c) for c in CASES])
def test_contract(launcher, suite, check, shared_dir):
    result, ranks = _run(launcher, suite, shared_dir)
    result.check()
    assert sorted(ranks) == list(range(NPROC[launcher])), f"missing rank results:\n{result.output[-3000:]}"
    for r, data in ranks.items():
        identity = data["identity"]
        assert identity["backend"] == BACKEND_OF[launcher], identity
        assert identity["world_size"] == NPROC[launcher], identity
        assert data["results"][check] == "ok", f"rank {r}: {data['results'][check]}"


def test_every_checkpoint_loaded_by_every_other_backend(shared_dir):
    """Runs above wrote ckpt_<backend>.pt in launcher order; the last one must have loaded all others,
    and this plain process loads the last one's."""
    for launcher in LAUNCHERS:
        _run(launcher, "core", shared_dir)
    seen = json.loads((shared_dir / "loaded_by_horovod_rank1.json").read_text())
    assert seen == ["ckpt_accelerate.pt", "ckpt_single.pt", "ckpt_torch.pt"], seen
    import torch

    import unified_dist as ud
    theirs = ud.load(str(shared_dir / "ckpt_horovod.pt"))
    mine = ud.load(str(shared_dir / "ckpt_single.pt"))
    for key in ("weight", "bias"):
        assert torch.allclose(theirs["model"][key], mine["model"][key], atol=1e-6)
    assert os.path.exists(shared_dir / "ckpt_torch.pt")
