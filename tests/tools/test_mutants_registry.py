"""The mutation check's list stays usable: every mutant still applies to the code as it is, names
tests that exist, and the recorded run (tools/mutants/results/mutants.json) caught every listed mutant.

The mutants themselves run in `make mutants` (tools/mutants/mutants.py), not here: each reruns launches."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from unified_dist.testing.launchers import ROOT

sys.path.insert(0, str(ROOT / "tools" / "mutants"))
import mutants  # noqa: E402  (tools/mutants/mutants.py)

MUTANTS = mutants.load()
RESULTS = ROOT / "tools" / "mutants" / "results" / "mutants.json"
ADDED = sorted((ROOT / "tools" / "mutants" / "results").glob("mutants_added*.json"))


def test_the_list_has_at_least_twelve_named_promises():
    assert len(MUTANTS) >= 12, len(MUTANTS)
    for m in MUTANTS:
        assert m["promise"].strip() and m["tests"], m["name"]
        assert m["old"] != m["new"], m["name"]


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m["name"] for m in MUTANTS])
def test_each_mutant_applies_exactly_once(mutant, tmp_path):
    target = tmp_path / mutant["file"]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text((ROOT / mutant["file"]).read_text())
    mutants.apply(tmp_path, mutant)  # raises unless `old` occurs exactly once
    assert target.read_text() != (ROOT / mutant["file"]).read_text()


def _collected(request, files) -> list:
    """The node ids of ``files``: this session's own collection where it holds them all (``make test`` collects
    every file, on each xdist worker too), else one ``pytest --collect-only`` of them (this file run alone)."""
    ids = [item.nodeid for item in request.session.items]
    if set(files) <= {i.split("::")[0] for i in ids}:
        return ids
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                *files], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert collected.returncode == 0, collected.stdout[-2000:]
    return [line for line in collected.stdout.splitlines() if "::" in line]


def test_every_guarding_test_exists(request):
    """Every file the list names, collected; each node id must be collected and each ``-k`` expression must select
    something in its file (a renamed test would make its mutant 'error')."""
    from _pytest.mark.expression import Expression

    files = sorted({t.partition(" -k ")[0].split("::")[0] for m in MUTANTS for t in m["tests"]})
    ids = _collected(request, files)
    for m in MUTANTS:
        for test in m["tests"]:
            path, _, expression = test.partition(" -k ")
            if not expression:
                assert path in ids, f"{m['name']}: no test {path}"
                continue
            matcher = Expression.compile(expression)
            assert any(i.startswith(path + "::") and matcher.evaluate(lambda word, i=i: word in i) for i in ids), \
                f"{m['name']}: -k {expression!r} selects nothing in {path}"


def test_the_recorded_run_caught_every_listed_mutant():
    """tools/mutants/results/mutants.json is the last full `make mutants`. A mutant added since is recorded by a
    run of the new ones alone (`python tools/mutants/mutants.py --only NAMES --out
    tools/mutants/results/mutants_added<_what>.json`, its guarding tests' baseline included; one file per batch of
    mutants), until the next full run takes them in. A mutant recorded in several files counts by the last of them
    in name order."""
    outcomes = {}
    for path in [RESULTS, *ADDED]:
        record = json.loads(path.read_text())
        assert record["commit"] and record["command"].startswith("python"), (path.name, record.get("command"))
        if path != RESULTS:
            assert "--only" in record["command"] and record["baseline"]["exit"] == 0, record["command"]
        outcomes.update({name: entry["outcome"] for name, entry in record["mutants"].items()})
    missing = [m["name"] for m in MUTANTS if m["name"] not in outcomes]
    assert not missing, f"not in the recorded runs (run `make mutants`): {missing}"
    assert all(outcome == "caught" for outcome in outcomes.values()), outcomes


def test_the_readme_counts_the_mutants_there_are():
    text = (ROOT / "README.md").read_text()
    assert f"`make mutants` breaks\n{len(MUTANTS)} documented promises" in text, "README's mutant count is stale"
