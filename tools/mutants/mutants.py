"""The mutation check: break each documented promise on a copy of the code and see a test fail.

    python tools/mutants/mutants.py                  # every mutant in tools/mutants/mutants.toml
    python tools/mutants/mutants.py --only NAME ...  # some of them
    python tools/mutants/mutants.py --list           # names, promises, guarding tests
    make mutants                             # the same as the first line, from a fresh clone

Each mutant in tools/mutants/mutants.toml names a promise the docs make, one edit of the library that
breaks it (``old`` must occur exactly once in ``file``: an edit that no longer applies is reported
``stale``, never silently skipped), and the tests that guard it. For each mutant this script copies
the repository's files (``git ls-files``, so only what a fresh clone has) into a temporary
directory, applies the edit there, and runs the guarding tests with that copy first on
``PYTHONPATH`` (the launch helpers in unified_dist/testing put it on every launched worker's path
too). The working tree is never modified.

Outcomes: ``caught`` (pytest exit 1: a test failed), ``survived`` (exit 0: the tests passed with the
promise broken), ``error`` (any other exit: collection error, usage error, no tests selected — not
counted as caught, since a broken import is not a test that guards the promise), ``timeout``,
``stale``. Before the mutants, the union of their guarding tests runs once on an unmodified copy
(``--no-baseline`` skips it): a test that fails without a mutant cannot catch one.

Writes tools/mutants/results/mutants.json (``--out``): commit, command, load, and per mutant its outcome,
seconds and the failing test's first lines. Exits 1 unless every mutant was caught.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11 (the package supports 3.9; this tool needs 3.11)
    raise SystemExit("tools/mutants/mutants.py needs Python 3.11 or newer (tomllib); make setup's venv has it") \
        from None

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "shared"))

import provenance  # noqa: E402  (bench/shared/provenance.py)

REGISTRY = Path(__file__).resolve().parent / "mutants.toml"
RESULTS = Path(__file__).resolve().parent / "results"
FIELDS = {"name", "promise", "file", "old", "new", "tests"}


def load(path: Path = REGISTRY) -> List[dict]:
    """The mutants of ``path``, each checked for the fields it needs and a unique name."""
    with open(path, "rb") as f:
        mutants = tomllib.load(f).get("mutant", [])
    seen = set()
    for m in mutants:
        missing = FIELDS - set(m)
        if missing:
            raise SystemExit(f"{path.name}: mutant {m.get('name', '?')!r} lacks {', '.join(sorted(missing))}")
        if m["name"] in seen:
            raise SystemExit(f"{path.name}: two mutants are named {m['name']!r}")
        seen.add(m["name"])
        if isinstance(m["tests"], str):
            m["tests"] = [m["tests"]]
    return mutants


def copy_tree(destination: Path) -> None:
    """The files a fresh clone has (tracked, plus untracked ones git does not ignore) into ``destination``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def apply(tree: Path, mutant: dict) -> None:
    """Apply ``mutant``'s edit inside ``tree``; ValueError if ``old`` is not there exactly once."""
    path = tree / mutant["file"]
    text = path.read_text()
    count = text.count(mutant["old"])
    if count != 1:
        raise ValueError(f"{mutant['file']}: the text to replace occurs {count} times (must be once)")
    path.write_text(text.replace(mutant["old"], mutant["new"]))


def node_ids(tree: Path, test: str) -> List[str]:
    """The pytest node ids ``test`` names: itself, or what ``path -k expression`` selects in ``tree``."""
    path, _, expression = test.partition(" -k ")
    if not expression:
        return path.split()
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             *path.split(), "-k", expression], cwd=tree, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(tree)), timeout=300)
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"{test!r} selects no test:\n{listed.stdout[-1500:]}")
    return ids


def pytest(tree: Path, ids: List[str], timeout: float, first_failure: bool = True) -> tuple:
    """Run the tests ``ids`` in ``tree``; (exit code, or None on timeout; output)."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=--strict-markers",
            "--no-header", "-rf", *(["-x"] if first_failure else []), *ids]
    env = dict(os.environ, PYTHONPATH=str(tree), CI="true", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a timeout kills the launches too
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output
    return proc.returncode, output


def failed_lines(output: str) -> List[str]:
    """pytest's ``FAILED ...`` summary lines (the first few), each cut to 300 characters."""
    return [line[:300] for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))][:5]


def check_imports_the_copy(tree: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree))
    where = subprocess.run([sys.executable, "-c", "import unified_dist; print(unified_dist.__file__)"], env=env,
                           capture_output=True, text=True, cwd=tree).stdout.strip()
    if not where.startswith(str(tree)):
        raise SystemExit(f"the copy's unified_dist is not the one imported (got {where!r}); is PYTHONPATH honoured?")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run of the guarding tests unmodified")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds for one mutant's tests (default 1200)")
    parser.add_argument("--out", help="results file (default tools/mutants/results/mutants.json; with --only, "
                                      "mutants_partial.json, which git ignores)")
    args = parser.parse_args(argv)
    args.out = args.out or str(RESULTS / ("mutants_partial.json" if args.only else "mutants.json"))
    mutants = load()
    if args.only:
        unknown = sorted(set(args.only) - {m["name"] for m in mutants})
        if unknown:
            parser.error(f"no mutant named {', '.join(unknown)}; see --list")
        mutants = [m for m in mutants if m["name"] in args.only]
    if args.list:
        for m in mutants:
            print(f"{m['name']}\n    promise: {m['promise']}\n    breaks:  {m['file']}\n"
                  f"    tests:   {'; '.join(m['tests'])}")
        return 0

    record: Dict = {**provenance.start(), "mutants": {}}
    with tempfile.TemporaryDirectory(prefix="ud-mutants-") as scratch:
        clean = Path(scratch) / "clean"
        copy_tree(clean)
        check_imports_the_copy(clean)
        for m in mutants:
            m["ids"] = [i for test in m["tests"] for i in node_ids(clean, test)]
        if not args.no_baseline:
            started = time.monotonic()
            everything = list(dict.fromkeys(i for m in mutants for i in m["ids"]))
            code, output = pytest(clean, everything, args.timeout * 2, first_failure=False)
            tally = re.findall(r"^=*\s*(\d+ passed.*?)\s*=*$", output, re.M)
            record["baseline"] = {"exit": code, "seconds": round(time.monotonic() - started, 1),
                                  "tests": tally[-1] if tally else "", "failed": failed_lines(output)}
            print(f"baseline: exit {code} in {record['baseline']['seconds']} s ({record['baseline']['tests']})",
                  flush=True)
            if code != 0:
                print(output[-3000:])
                print("the guarding tests fail without any mutant: fix them first", file=sys.stderr)
                return 2
        for m in mutants:
            tree = Path(scratch) / re.sub(r"[^A-Za-z0-9_.-]", "_", m["name"])
            shutil.copytree(clean, tree, symlinks=True)
            started = time.monotonic()
            try:
                apply(tree, m)
            except ValueError as exc:
                outcome, code, output = "stale", None, str(exc)
            else:
                code, output = pytest(tree, m["ids"], args.timeout)
                outcome = {None: "timeout", 0: "survived", 1: "caught"}.get(code, "error")
            seconds = round(time.monotonic() - started, 1)
            record["mutants"][m["name"]] = {"outcome": outcome, "exit": code, "seconds": seconds,
                                            "promise": m["promise"], "file": m["file"], "tests": m["tests"],
                                            "ran": len(m["ids"]),
                                            "failed": failed_lines(output) if outcome == "caught" else [],
                                            "tail": "" if outcome == "caught" else output[-1500:]}
            print(f"{outcome:9s} {m['name']}  ({seconds} s)", flush=True)
            shutil.rmtree(tree, ignore_errors=True)
    provenance.finish(record)
    outcomes = [v["outcome"] for v in record["mutants"].values()]
    record["summary"] = {k: outcomes.count(k) for k in ("caught", "survived", "error", "timeout", "stale")}
    record.pop("cpu_ticks_before", None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"{record['summary']['caught']} of {len(outcomes)} caught; results in {args.out}")
    return 0 if outcomes and all(o == "caught" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
