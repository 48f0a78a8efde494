"""The BERT example stops on a preemption signal and resumes exactly (docs/preemption.md).

`python train.py` on the 2-layer BERT of test_bert_hotpath.py: SIGTERM after its first optimizer step is
logged and before the loop first asks ud.should_stop() (the run paused there by pause_before_ask.py until the
signal is recorded: no race with the machine's speed) -> the signal is held, the first ask is False, and the
run stops at optimizer step 2, writes that step's checkpoint and exits 75 (ud.requeue outside SLURM);
`--resume auto` then finishes the run with the weights of an uninterrupted run (one process,
the same order of float32 sums: equal within 1e-6, as the other resume tests of the example)."""
from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_bert_hotpath import _missing  # pytest puts this folder on sys.path

from unified_dist.testing.launchers import ROOT, child_env, command, kill_session, launch

EXAMPLE = ROOT / "examples" / "bert_sentiment"
PAUSE = str(Path(__file__).with_name("pause_before_ask.py"))
pytestmark = [pytest.mark.example, pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.skipif(bool(_missing), reason=f"example dependencies missing: {_missing} (make setup)")]
STEPS = 8  # the run stops at step 2 whatever the machine's speed (pause_before_ask.py): 6 steps after the resume
ARGS = ["--limit-train", "96", "--limit-eval", "32", "--max-length", "16", "--batch-size", "8", "--eval-batch-size",
        "8", "--epochs", "1", "--max-steps", str(STEPS), "--log-every", "1", "--eval-every", "0", "--save-every", "0",
        "--no-dropout", "--no-progress", "--no-plots", "--resume", "auto"]


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "final_model" / "model.safetensors"))


def test_sigterm_stops_saves_exits_75_and_resume_auto_ends_with_the_uninterrupted_weights(tmp_path: Path,
                                                                                           tiny_bert: str) -> None:
    model = tiny_bert
    reference = tmp_path / "uninterrupted"
    # the uninterrupted reference runs beside the stopped run and its resume (one process each, one thread of
    # torch each: on 2 cores they overlap, where one after the other they were 3 launches end to end); the two
    # share nothing (own output folders, no port), and no assertion reads a timing
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # its end waits for the reference, however the test ends
        uninterrupted = pool.submit(launch, "python", str(EXAMPLE / "train.py"),
                                    [*ARGS, "--model", model, "--output-dir", str(reference)], nproc=1, timeout=240)
        out = tmp_path / "stopped"
        marker = tmp_path / "asking"
        argv = command("python", PAUSE, [str(marker), "1", str(EXAMPLE / "train.py"), *ARGS, "--model", model,
                                         "--output-dir", str(out)])
        log = tmp_path / "stopped.log"
        with open(log, "w") as handle:
            proc = subprocess.Popen(argv, cwd=ROOT, env=child_env(), stdout=handle, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            deadline = time.monotonic() + 240  # a failure's bound, not a pace: the run waits for the signal
            while proc.poll() is None and time.monotonic() < deadline:
                if Path(f"{marker}.rank0").exists():  # step 1 logged; the first ud.should_stop() waits for the signal
                    assert '"train"' in (out / "metrics.jsonl").read_text()
                    proc.send_signal(signal.SIGTERM)
                    break
                time.sleep(0.02)
            proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                kill_session(proc.pid)
        output = log.read_text()
        assert proc.returncode == 75, output[-3000:]
        said = [line for line in output.splitlines() if line.startswith("stop signal: saved step ")]
        assert len(said) == 1, output[-3000:]
        stopped = int(said[0].split()[4].rstrip(";"))
        assert stopped == 2  # held through step 1's first ask, agreed at the next optimizer step
        assert (out / "checkpoints" / f"checkpoint-{stopped:09d}.pt").exists()
        assert not (out / "final_model").exists()
        launch("python", str(EXAMPLE / "train.py"), [*ARGS, "--model", model, "--output-dir", str(out)],
               nproc=1, timeout=240).check()
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        assert max(r["step"] for r in rows if r["type"] == "train") == STEPS
        uninterrupted.result().check()
        resumed, expected = _weights(out), _weights(reference)
        assert resumed.keys() == expected.keys()
        assert max((resumed[k] - expected[k]).abs().max().item() for k in expected) <= 1e-6
