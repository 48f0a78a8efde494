"""bench/replicas/replica_cost.py and bench/replicas/replica_soak.py (issue #53) and what docs/fault-tolerance.md says
of them.

Fast: no process is launched. The committed results files must hold what the page claims, recomputed here
from their raw rows (each run's median step, each kill's recovery), not read from the scripts' summaries."""
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "replicas" / "results"


def load(name: str) -> dict:
    data = json.loads((RESULTS / name).read_text())
    assert data["commit"] and data["command"].startswith(f"python bench/{name.replace('.json', '.py')}")
    return data


def test_the_step_with_replica_groups_costs_at_most_ten_percent_more_in_the_same_run():
    data = load("replica_cost.json")
    runs = data["runs"]
    by_side = {side: [r["median_step_s"] for r in runs if r["side"] == side] for side in ("off", "on")}
    assert len(by_side["off"]) == len(by_side["on"]) >= 3  # interleaved rounds, both sides
    ratio = statistics.median(by_side["on"]) / statistics.median(by_side["off"])
    assert abs(ratio - data["summary"]["ratio_on_off"]) < 1e-9
    assert ratio <= 1.10
    assert all(r["digests_equal"] for r in runs)
    assert len({r["digest"] for r in runs}) == 1  # the same final weights with and without replica groups
    assert all(dp == 2 for r in runs if r["side"] == "on" for dp in r["dp"])


def test_the_soak_survived_ten_kills_with_every_step_in_order_and_equal_weights():
    data = load("replica_soak.json")
    assert (data["rc"], data["timed_out"]) == (0, False)
    assert len(data["kills"]) == 10 and data["launcher_restart_lines"] == 10
    assert all(data["checks"].values()), data["checks"]
    recoveries = [k["recovery_s"] for k in data["kills"]]
    assert abs(statistics.median(recoveries) - data["summary"]["recovery_s_median"]) < 1e-9
    pauses = [k["survivors_longest_pause_s"] for k in data["kills"]]
    assert max(pauses) == data["summary"]["survivors_longest_pause_s_max"]
