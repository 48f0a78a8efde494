"""Recovery from a killed worker: torchrun/accelerate restart + checkpoint, Horovod elastic in memory.

The worker (tests/launchers/workers/elastic_worker.py) trains with ud.ElasticState/ud.elastic_run and
SIGKILLs one of its processes once, mid-epoch.
"""
import json

import pytest
import torch

from unified_dist.testing.launchers import BIN, child_env, free_port, launch, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = "tests/launchers/workers/elastic_worker.py"


def result(out):
    entries = [json.loads(line) for line in (out / "entries.jsonl").read_text().splitlines()]
    return json.loads((out / "result.json").read_text()), entries


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    launch("torchrun", WORKER, ["--out", str(out)], timeout=120).check()
    return result(out)[0]


# static rendezvous keeps one agent store across restarts (stale gloo addresses: see
# unified_dist/backends/process_group.py); c10d rendezvous makes a new one per attempt
@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_torchrun_restarts_and_resumes_exactly(tmp_path, uninterrupted, rendezvous):
    where = ["--standalone"] if rendezvous == "c10d" else ["--master_port", str(free_port())]
    cmd = [str(BIN / "torchrun"), *where, "--nproc_per_node", "2", "--max-restarts", "2",
           WORKER, "--out", str(tmp_path), "--kill-at", "10"]
    run(cmd, timeout=180).check()
    final, entries = result(tmp_path)
    restarted = [e for e in entries if e["restored_from"]]
    assert len(restarted) == 2 and all(e["step"] == 8 for e in restarted), entries  # the step-8 commit
    assert final["step"] == uninterrupted["step"]
    assert torch.allclose(torch.tensor(final["weights"]), torch.tensor(uninterrupted["weights"]), atol=1e-6, rtol=0)


def test_accelerate_launch_restarts_and_resumes_exactly(tmp_path, uninterrupted):
    cmd = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           "--max_restarts", "2", WORKER, "--out", str(tmp_path), "--kill-at", "10"]
    run(cmd, timeout=180).check()
    final, entries = result(tmp_path)
    assert [e["step"] for e in entries if e["restored_from"]] == [8, 8], entries
    assert torch.allclose(torch.tensor(final["weights"]), torch.tensor(uninterrupted["weights"]), atol=1e-6, rtol=0)


def test_horovod_elastic_continues_without_the_lost_worker_and_takes_a_new_one(tmp_path):
    discover = tmp_path / "discover.sh"
    # two names for this machine: horovod blacklists the host of a failed worker, and with a
    # single host name nothing would be left to run on
    discover.write_text("#!/bin/sh\necho localhost:1\necho 127.0.0.1:1\n")
    discover.chmod(0o755)
    cmd = [str(BIN / "horovodrun"), "--gloo", "--network-interfaces", "lo", "-np", "2", "--min-np", "1",
           "--max-np", "2", "--host-discovery-script", str(discover), "--blacklist-cooldown-range", "1", "2",
           "python", WORKER, "--out", str(tmp_path), "--kill-at", "10"]
    run(cmd, timeout=240, env=child_env()).check()
    final, entries = result(tmp_path)
    assert final["epoch"] == 2
    survivor = [e for e in entries if e["world"] == 1]
    assert survivor and survivor[0]["step"] == 8, entries  # rolled back to the in-memory step-8 commit
    assert entries[-1]["world"] == 2 and final["world"] == 2, entries  # a new worker joined later
    assert all(abs(w) < 10 for w in final["weights"])
