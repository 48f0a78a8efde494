"""bench/horovod/hvd_synthetic.py (issue #40's benchmark) and its page, docs/benchmarks/horovod-synthetic.md.

Fast: no process is launched. The committed results file must hold every round of every side with the
engine each side claims, and its summary must be the medians recomputed here; the page's figures must
be that file's values (formatted here with json, not through the hook's lookup), and change when it
does. The driver's arithmetic is checked with the launches replaced by a stand-in that writes known
throughputs."""
import json
import statistics
import sys
import types
from pathlib import Path

import pytest

from unified_dist.testing.launchers import bench_module

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "horovod" / "results"
PAGE = ROOT / "docs" / "benchmarks" / "horovod-synthetic.md"
ENGINE = {"shim": "unified_dist.horovod", "real": "horovod.torch", "real_cycle": "horovod.torch"}


@pytest.fixture(scope="module")
def bench():
    return bench_module("bench/horovod/hvd_synthetic")


@pytest.fixture(scope="module")
def hook():
    return bench_module("tools/docs_hook")


def _results():
    return json.loads((RESULTS / "hvd_synthetic.json").read_text())


def test_results_hold_every_round_of_every_side_and_their_medians():
    data = _results()
    for key in ("commit", "command", "cpu", "load_before", "load_after", "steal_fraction", "settings"):
        assert key in data, key
    rounds = data["settings"]["rounds"]
    assert rounds >= 3 and data["settings"]["omp_num_threads"] == 1
    assert set(data["runs"]) == set(ENGINE)
    assert data["commands"]["shim"].startswith("PYTHONPATH=unified_dist/horovod/_shim")
    assert " torchrun --nproc_per_node 2 " in data["commands"]["shim"]
    assert data["commands"]["real"].startswith("horovodrun -np 2 -H localhost:2 --gloo python ")
    assert "--cycle-time-ms 5 " in data["commands"]["real_cycle"]
    for side, runs in data["runs"].items():
        assert [r["round"] for r in runs] == list(range(rounds)), side
        for r in runs:
            assert r["implementation"] == ENGINE[side] and r["size"] == 2
            assert len(r["images_per_s_per_process"]) == 2 and len(r["load_after"]) == 3
            assert r["images_per_s_total"] == pytest.approx(sum(r["images_per_s_per_process"]))
            assert len(r["images_per_s_per_iter_rank0"]) == data["settings"]["iters"]
            assert r["weights_max_spread"] <= 1e-5
    median = {side: statistics.median(r["images_per_s_total"] for r in runs) for side, runs in data["runs"].items()}
    s = data["summary"]
    assert s["shim_images_per_s"] == pytest.approx(median["shim"])
    assert s["real_images_per_s"] == pytest.approx(median["real"])
    assert s["real_cycle_images_per_s"] == pytest.approx(median["real_cycle"])
    assert s["ratio"] == pytest.approx(median["shim"] / median["real"])
    assert s["ratio_vs_real_cycle"] == pytest.approx(median["shim"] / median["real_cycle"])


def test_the_page_shows_the_results_values(hook):
    data, text = _results(), hook.render(PAGE.read_text())
    s = data["summary"]
    assert f"**unified_dist.horovod / real Horovod: {s['ratio']:.3f}**" in text
    assert f"{s['shim_images_per_s']:.0f} against\n  {s['real_images_per_s']:.0f} images/s" in text
    assert f"commit `{data['commit']}`" in text and f"`python {data['command'].split(' ', 1)[1]}`" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == data["settings"]["rounds"]
    for k, row in enumerate(rows):
        runs = {side: data["runs"][side][k] for side in ENGINE}
        assert [c.strip() for c in row.strip("|").split("|")] == [
            str(k), f"{runs['shim']['images_per_s_total']:.0f}", f"{runs['real']['images_per_s_total']:.0f}",
            f"{runs['real_cycle']['images_per_s_total']:.0f}",
            f"{runs['shim']['images_per_s_total'] / runs['real']['images_per_s_total']:.2f}",
            f"{runs['shim']['load_after'][0]:.1f}"]
    migration = hook.render((ROOT / "docs" / "horovod-migration.md").read_text())
    assert f"gave\n{s['ratio']:.2f} × the images/s of real Horovod" in migration


def test_a_changed_results_file_changes_the_page(hook, tmp_path):
    copy = tmp_path / RESULTS.relative_to(ROOT)  # the hook names results files by their paths from the root
    copy.mkdir(parents=True)
    data = _results()
    data["summary"]["ratio"] = 0.87654
    data["runs"]["shim"][1]["images_per_s_total"] = 4321.0
    (copy / "hvd_synthetic.json").write_text(json.dumps(data))
    text = hook.render(PAGE.read_text(), tmp_path)
    assert "real Horovod: 0.877**" in text and "| 1 | 4321 |" in text


def _expect(argv):
    return argv[argv.index("--expect") + 1]


def test_the_sides_launch_the_engines_they_name(bench):
    from unified_dist.backends.buckets import CPU_CYCLE_MS
    from unified_dist.horovod.redirect import SHIM_DIR

    args = types.SimpleNamespace(batch_size=4, warmup=1, iters=1, batches_per_iter=1)
    shim, shim_env = bench.launch_argv("shim", Path("/tmp/x.json"), args)
    real, real_env = bench.launch_argv("real", Path("/tmp/x.json"), args)
    cycle, _ = bench.launch_argv("real_cycle", Path("/tmp/x.json"), args)
    assert Path(shim[0]).name == "torchrun" and "--master_port" in shim and _expect(shim) == "shim"
    assert shim_env["PYTHONPATH"].split(":")[0] == SHIM_DIR and SHIM_DIR not in real_env["PYTHONPATH"]
    assert Path(real[0]).name == "horovodrun" and real[1:6] == ["-np", "2", "-H", "localhost:2", "--gloo"]
    assert _expect(real) == _expect(cycle) == "real" and "--cycle-time-ms" not in real
    assert cycle[cycle.index("--cycle-time-ms") + 1] == str(CPU_CYCLE_MS)


def test_the_driver_takes_medians_of_rounds_and_rotates_the_order(bench, monkeypatch):
    import unified_dist.testing.launchers as launchers

    speed = {"shim": [300.0, 100.0, 200.0], "real": [50.0, 400.0, 100.0], "real_cycle": [80.0, 90.0, 70.0]}
    order = []

    def fake_run(argv, timeout, env=None, cwd=None):
        side = "shim" if "torchrun" in argv[0] else ("real_cycle" if "--cycle-time-ms" in argv else "real")
        order.append(side)
        k = sum(s == side for s in order) - 1
        out = Path(argv[argv.index("--out") + 1])
        out.write_text(json.dumps({"implementation": ENGINE[side], "size": 2,
                                   "images_per_s_per_process": [speed[side][k] / 2] * 2,
                                   "images_per_s_total": speed[side][k]}))
        return types.SimpleNamespace(check=lambda: None)

    monkeypatch.setattr(launchers, "run", fake_run)
    sys.path.insert(0, str(ROOT / "bench" / "shared"))
    args = types.SimpleNamespace(batch_size=4, warmup=1, iters=1, batches_per_iter=1, rounds=3, timeout=10)
    s = bench.drive(args)["summary"]
    assert order[:3] == ["shim", "real", "real_cycle"] and order[3:6] == ["real", "real_cycle", "shim"]
    assert (s["shim_images_per_s"], s["real_images_per_s"], s["real_cycle_images_per_s"]) == (200.0, 100.0, 80.0)
    assert s["ratio"] == 2.0 and s["ratio_vs_real_cycle"] == 2.5
