"""``make gpu-check`` / ``unified-dist test --gpu`` (unified_dist/checks/gpu.py, gpu_checks.py) without a
GPU: the dry run (``--device cpu``) runs every check's code and records it; the runner kills a check
that overruns and goes on; the CUDA-only calls (``set_sync_debug_mode``, ``synchronize``) are faked;
without a GPU the Makefile's command prints one line and exits 0; docs/gpus.md renders the results."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from unified_dist.checks import gpu, gpu_checks
from unified_dist.cli.main import main as cli

ROOT = Path(__file__).resolve().parents[3]
SINGLE_PROCESS = [name for name in gpu.NAMES if not name.endswith("sync_batchnorm")]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNIFIED_DIST_", "RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **extra)
    return env


def _hook():
    spec = importlib.util.spec_from_file_location("docs_hook", ROOT / "tools" / "docs_hook.py")
    hook = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("docs_hook", hook)
    spec.loader.exec_module(hook)
    return hook


def test_the_runner_and_the_worker_list_the_same_checks():
    assert tuple(gpu_checks.CHECKS) == gpu.NAMES
    assert set(gpu.BUDGET) == set(gpu.NAMES)
    assert sum(gpu.BUDGET.values()) <= 2 * gpu.DEFAULT_TOTAL_S


def test_without_a_gpu_the_makefile_command_prints_one_line_and_exits_0():
    recipe = re.search(r"^gpu-check: setup\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert recipe, "the Makefile has no gpu-check target depending on setup"
    command = shlex.split(recipe.group(1).replace("$(PY)", sys.executable))
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and "no CUDA GPU here" in done.stdout, done.stdout


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``unified-dist test --gpu --device cpu`` over every one-process check, with its results file."""
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check_20261126.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # here, so that only the worker is a second process
        status = cli(["test", "--gpu", "--device", "cpu", "--only", ",".join(SINGLE_PROCESS), "--results", str(out)])
    return subprocess.CompletedProcess([], status, printed.getvalue(), ""), out


def test_the_dry_run_runs_every_check_compares_and_records(dry_run):
    done, out = dry_run
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    for key in ("commit", "command", "load_before", "load_after", "device", "torch", "date"):
        assert key in record, key
    assert record["device"].startswith("cpu (dry run")
    checks = {c["name"]: c for c in record["checks"]}
    assert list(checks) == SINGLE_PROCESS and record["passed"] == record["total"] == len(SINGLE_PROCESS)
    for name, c in checks.items():
        assert c["status"] == "pass" and c["figure"] is not None and c["seconds"] >= 0, (name, c)
        assert name in done.stdout
    for name in ("fsdp2", "hsdp", "tensor_parallel", "pinned_cpu_offload"):  # against the float64 reference
        assert 0 <= checks[name]["figure"] <= checks[name]["limit"] == 1e-4
    assert checks["pinned_cpu_offload"]["extra"] == {"pinned": False}  # pinned only where there is a GPU
    assert checks["host_syncs_per_micro_step"]["figure"]["per_micro_step"] == [0] * 6
    assert set(checks["fp16_grad_scaling"]["figure"]) == {"SGD", "Adam", "AdamW"}
    assert checks["compile_speedup"]["figure"]["max_param_difference"] <= 1e-3
    assert checks["cuda_rng_states"]["figure"] == {"same_draws": True, "cuda_states_saved": False}
    # the Accelerate backend in bf16 (the dry run's mode) against the torch backend: the same weights
    assert checks["accelerate_mixed_precision"]["figure"] == {
        "max_difference": 0.0, "applied": 8, "torch_applied": 8, "outside_autocast": "torch.float32",
        "inside_autocast": "torch.bfloat16", "loss_scaled": False}


def test_docs_render_the_newest_results_file_or_the_checks_not_yet_run(dry_run, tmp_path):
    hook = _hook()
    empty = hook.render("<!-- results: - gpu-checks -->", tmp_path)
    assert "not yet run" in empty and all(f"- `{name}`" in empty for name in gpu.NAMES)
    _, out = dry_run
    folder = tmp_path / hook.GPU_CHECKS  # bench/gpu/results under the root given
    folder.mkdir(parents=True)
    (folder / "gpu_check_20261101.json").write_text("{}")  # older: not the one shown
    (folder / out.name).write_text(out.read_text())
    page = hook.render("<!-- results: - gpu-checks -->", tmp_path)
    record = json.loads(out.read_text())
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) == len(record["checks"])
    for row, c in zip(rows, record["checks"]):
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert cells[0] == f"`{c['name']}`" and cells[2] == c["status"]
        assert cells[3] == gpu.figure_text(c["figure"]).replace("|", "\\|")
    assert f"- `bench/gpu/results/{out.name}`: commit `{record['commit']}`" in page


FAKE_WORKER = textwrap.dedent("""
    import json, os, sys, time
    args = sys.argv[1:]
    out = args[args.index("--out") + 1]
    for name in args[args.index("--out") + 2:]:
        path = os.path.join(out, name + ".json")
        json.dump({"status": "running", "started": time.time()}, open(path, "w"))
        if name == "hangs":
            open(os.path.join(out, "hung.pid"), "w").write(str(os.getpid()))
            time.sleep(60)
        if name == "crashes":
            os._exit(3)
        json.dump({"status": "pass", "figure": 1.0, "seconds": 0.0}, open(path, "w"))
""")


def test_a_check_that_hangs_is_killed_one_that_crashes_fails_and_the_others_still_run(tmp_path):
    fake = tmp_path / "fake_worker.py"
    fake.write_text(FAKE_WORKER)
    names = ["first", "hangs", "crashes", "last"]
    start = time.monotonic()
    records = gpu.run_checks(names, "cpu", total_s=60, budget=dict.fromkeys(names, 1.5),
                                   worker=(sys.executable, str(fake)))
    assert time.monotonic() - start < 40  # the hung worker (asleep for 60 s) was killed, not waited for
    by_name = {r["name"]: r for r in records}
    assert [r["name"] for r in records] == names
    assert by_name["first"]["status"] == by_name["last"]["status"] == "pass"
    assert by_name["hangs"]["status"] == "timeout" and "1.5s budget" in by_name["hangs"]["detail"]
    assert by_name["crashes"]["status"] == "FAIL" and "exit status 3" in by_name["crashes"]["detail"]


def test_a_run_out_of_total_budget_leaves_the_rest_not_run(tmp_path):
    fake = tmp_path / "fake_worker.py"
    fake.write_text(FAKE_WORKER)
    records = gpu.run_checks(["hangs", "last"], "cpu", total_s=4.0, budget={"hangs": 30, "last": 30},
                                   worker=(sys.executable, str(fake)))
    assert [r["status"] for r in records] == ["timeout", "not run"]
    assert "total budget" in records[0]["detail"]


def test_host_syncs_are_counted_from_the_sync_debug_mode_warnings(monkeypatch):
    modes, synced = [], []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append(True))
    with gpu_checks.counting_syncs(torch.device("cuda")) as seen:
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert gpu_checks.syncs(seen) == 2
    assert modes == ["warn", "default"] and synced == [True]  # the queue drained first, the mode put back
    with gpu_checks.counting_syncs(torch.device("cpu")) as seen:
        pass
    assert modes == ["warn", "default"] and gpu_checks.syncs(seen) == 0


def test_the_fp16_check_compares_only_the_steps_the_grad_scaler_applied(monkeypatch):
    """fp16 on the CPU with the facade's GPU-only refusal faked away: GradScaler("cpu") starts at 2**16,
    so the first steps overflow and are skipped, as on a GPU; the reference leaves out the same steps."""
    monkeypatch.setattr("unified_dist.backends.precision.Precision.check_device", lambda *args, **kwargs: None)
    monkeypatch.setattr(gpu_checks, "precision_for", lambda device: "fp16")
    record = gpu_checks.run_one("fp16_grad_scaling", torch.device("cpu"))
    assert record["status"] == "pass", record
    skipped = record["extra"]["skipped"]
    assert set(skipped) == {"SGD", "Adam", "AdamW"} and all(1 <= n <= 4 for n in skipped.values()), skipped
    assert all(0 < v <= 0.1 for v in record["figure"].values())


def test_gpu_options_without_gpu_and_unknown_checks_are_one_line_usage_errors(capsys):
    assert cli(["test", "--only", "fsdp2"]) == 2
    assert cli(["test", "--gpu", "--only", "fsdp3"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert "--only go with --gpu" in err[0]
    assert "unknown GPU check(s) fsdp3; choose from fsdp2" in err[1]


@pytest.mark.distributed
def test_torch_sync_batchnorm_check_runs_two_ranks_and_compares():
    record = gpu_checks.run_one("torch_sync_batchnorm", torch.device("cpu"))
    assert record["status"] == "pass", record
    assert record["figure"] <= record["limit"] == 1e-4
    assert "unified_dist.parallel.sync_batchnorm.SyncBatchNorm on cpu" in record["detail"]  # CUDA's class on a GPU


@pytest.mark.distributed
@pytest.mark.horovod
def test_horovod_sync_batchnorm_check_runs_under_horovodrun_and_compares():
    record = gpu_checks.run_one("horovod_sync_batchnorm", torch.device("cpu"))
    assert record["status"] == "pass", record
    assert record["figure"] <= 1e-4
