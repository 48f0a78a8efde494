"""``unified-dist parity``: its parsing and comparison (its real use is in tests/examples)."""
import json

import pytest

from unified_dist.cli import parity
from unified_dist.cli.main import main


def unified_dist_parity(*args):
    return main(["parity", *args])


def write(tmp_path, name, losses, acc):
    d = tmp_path / name
    d.mkdir()
    lines = [{"type": "train", "step": s, "loss": loss} for s, loss in losses.items()]
    lines.append({"type": "eval", "step": max(losses), "accuracy": acc, "eval_examples": 50})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(d)


def test_parse_run():
    spec = parity.parse_run("accum=python:1 --grad-accum 2 --batch-size 8")
    assert ((spec.name, spec.backend, spec.nproc, spec.extra)
            == ("accum", "python", 1, ("--grad-accum", "2", "--batch-size", "8")))
    assert parity.parse_run("h=horovod:4").nproc == 4
    for bad in ("torch:2", "x=mpi:2", "x=torch:two", "x=python:2"):
        with pytest.raises(ValueError):
            parity.parse_run(bad)


def test_compare_reports_the_worst_step_and_fails_past_tolerance(tmp_path, capsys):
    ref = write(tmp_path, "ref", {1: 0.70, 2: 0.65, 3: 0.60}, 0.8)
    same = write(tmp_path, "same", {1: 0.70, 2: 0.65 * (1 + 1e-7), 3: 0.60}, 0.8)
    off = write(tmp_path, "off", {1: 0.70, 2: 0.66, 3: 0.60}, 0.8)
    assert unified_dist_parity("--compare", ref, same, "--rtol", "1e-5") == 0
    assert unified_dist_parity("--compare", ref, off, "--rtol", "1e-5") == 1
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("off")][0]
    assert "1.538e-02" in row and row.split()[3] == "2" and row.endswith("FAIL")


def test_missing_steps_or_eval_differences_fail(tmp_path):
    ref = write(tmp_path, "ref", {1: 0.7, 2: 0.6}, 0.8)
    short = write(tmp_path, "short", {1: 0.7}, 0.8)
    other_acc = write(tmp_path, "acc", {1: 0.7, 2: 0.6}, 0.82)
    assert unified_dist_parity("--compare", ref, short) == 1
    assert unified_dist_parity("--compare", ref, other_acc) == 1
    assert unified_dist_parity("--compare", ref, other_acc, "--eval-atol", "0.05") == 0
    assert unified_dist_parity("--compare", ref, str(tmp_path / "nothing")) == 2


def test_the_words_after_dashes_go_to_the_script(tmp_path, monkeypatch):
    ref = write(tmp_path, "ref", {1: 0.7}, 0.8)
    seen = []
    monkeypatch.setattr(parity, "_run_all", lambda args: seen.append(args.script_args) or [("a", ref), ("b", ref)])
    assert unified_dist_parity("s.py", "--run", "a=python", "--", "--rtol", "3", "--", "x") == 0
    assert seen == [["--rtol", "3", "--", "x"]]
