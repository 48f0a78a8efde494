"""bench/network/network.py's arithmetic and link settings, without making hosts (the run itself is a benchmark)."""
import importlib
from pathlib import Path

import pytest

from unified_dist.testing.launchers import bench_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def network():
    return bench_module("bench/network/network")


def test_rates_in_tc_units(network):
    assert network.rate_bits("10gbit") == 10e9
    assert network.rate_bits("200mbit") == 200e6
    with pytest.raises(SystemExit, match="NUMBER"):
        network.rate_bits("1GB/s")


def test_token_bucket_on_both_sides_with_netem_only_when_asked(network):
    (tbf,) = network.tc_commands("1gbit", "0ms")
    assert tbf == ["tc", "qdisc", "add", "dev", "udnet0", "root", "tbf", "rate", "1gbit", "burst", "250000",
                   "latency", "50ms"]
    assert network.tc_commands("200mbit", "0ms")[0][10] == str(64 * 1024)  # never below 64 KiB
    netem, child = network.tc_commands("1gbit", "1ms")
    assert netem[5:11] == ["root", "handle", "1:", "netem", "delay", "1ms"]
    assert child[5:7] == ["parent", "1:"] and "tbf" in child


def test_row_bound_efficiency_and_hidden_share(network):
    job = {"world_size": 2, "compression": "bf16", "grad_numel": 1_000_000, "backend": "torch",
           "launcher": "torchrun", "compression_per_rank": ["bf16", "bf16"], "commands": [], "samples_per_s": 15.0,
           "median_step_s": 1.5, "serialised_allreduce_s": 1.0, "wire_bytes_per_step": 4e6, "steps": 3, "warmup": 1,
           "batch_size": 16, "max_length": 64, "job_wall_s": 1.0, "step_times_s": [1.5, 1.5, 1.5]}
    one = {"samples_per_s": 10.0, "median_step_s": 1.0}
    row = network.summarise(job, one, "8mbit", "0ms", [])
    assert row["grad_bytes"] == 2_000_000
    assert row["ring_allreduce_bound_s"] == pytest.approx(2.0)  # 2(N-1)/N x 2 MB at 1 MB/s
    assert row["efficiency"] == pytest.approx(0.75)
    assert row["comm_hidden_fraction"] == pytest.approx(0.5)  # (1 + 1 - 1.5) / 1
    assert row["step_stat"] == "median" and row["horovod_cycle_ms"] is None
    assert row["quiet_microbatch_ratio"] is None and row["step_times_s"] == [1.5, 1.5, 1.5]


def test_accumulation_rows_are_per_optimizer_step(network):
    """With --accum k one all-reduce serves k micro-batches: the step figures are per optimizer
    step (k x the mean micro-batch time, on both sides), so the bound and the hidden share compare
    one all-reduce with k micro-batches of compute."""
    job = {"world_size": 2, "compression": None, "grad_numel": 250_000, "backend": "torch", "accum": 2,
           "launcher": "torchrun", "compression_per_rank": [None, None], "commands": [], "samples_per_s": 16.0,
           "median_step_s": 0.9, "mean_step_s": 1.25, "serialised_allreduce_s": 1.0, "wire_bytes_per_step": 2e6,
           "steps": 4, "warmup": 2, "batch_size": 16, "max_length": 64, "job_wall_s": 1.0,
           "step_times_s": [0.9, 1.6, 0.9, 1.6], "horovod_cycle_time": None}
    one = {"samples_per_s": 10.0, "median_step_s": 0.8, "mean_step_s": 1.0, "step_times_s": [0.6, 1.4, 0.6, 1.4]}
    row = network.summarise(job, one, "8mbit", "0ms", [])
    assert row["accum"] == 2 and row["step_stat"] == "mean"
    assert row["median_step_s"] == pytest.approx(2.5) and row["median_step_s_1host"] == pytest.approx(2.0)
    assert row["efficiency_if_not_overlapped_at_bound"] == pytest.approx(2.0 / 3.0)  # 2 / (2 + 1)
    assert row["comm_hidden_fraction"] == pytest.approx(0.5)  # (2 + 1 - 2.5) / 1
    assert row["quiet_microbatch_ratio"] == pytest.approx(1.5)  # the micro-batches that send nothing: 0.9 / 0.6


def test_a_cycle_time_and_a_bucket_size_reach_the_launch_line(network, monkeypatch, tmp_path):
    """--horovod-cycle-ms / --bucket-mb end up in the launched job's environment (and in the row)."""
    launched = {}
    monkeypatch.setattr(network.multinode, "launch_commands",
                        lambda *a: [(0, ["horovodrun", "-np", "2", "SCRIPT"], {"PATH": "/bin"})])

    def fake_run_job(hosts, name, commands, out):
        launched["name"], launched["commands"] = name, commands
        return {}
    monkeypatch.setattr(network, "run_job", fake_run_job)
    args = type("Args", (), {"steps": 3, "warmup": 1, "comm_reps": 1, "batch_size": 16, "max_length": 64,
                             "accum": 1})()
    job = network.two_hosts(None, None, "horovod", "bf16", args, tmp_path, bucket_mb="4", cycle_ms="5")
    (host, argv, env), = launched["commands"]
    assert env[network.CYCLE_VAR] == "5" and env[network.BUCKET_VAR] == "4"
    assert env[network.COMPRESSION_VAR] == "fp16"  # Horovod's 16-bit format
    assert argv[:3] == ["horovodrun", "-np", "2"] and argv[3] == network.WORKER
    assert launched["name"] == "horovod-fp16-4-5-viewon" and network.VIEW_ENV not in env
    assert job["horovod_cycle_ms"] == "5" and job["bucket_mb"] == "4"
    network.two_hosts(None, None, "torch", None, args, tmp_path, bucket_view=False)
    (host, argv, env), = launched["commands"]
    assert env[network.VIEW_ENV] == "0" and network.CYCLE_VAR not in env


def test_report_shows_the_cycle_horovod_read_and_the_quiet_ratio_against_the_rows_own_baseline(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench" / "network"))
    report = importlib.import_module("network_report")
    tc = ["tc qdisc add dev udnet0 root tbf rate 1gbit burst 250kb latency 50ms"]
    row = {"rate": "1gbit", "delay": "0ms", "backend": "horovod", "compression": "fp16", "bucket_mb": None,
           "horovod_cycle_ms": None, "horovod_cycle_ms_effective": "5", "accum": 2, "samples_per_s": 10.0,
           "efficiency": 0.5, "wire_bytes_per_step": 9e7, "ring_allreduce_bound_s": 0.36,
           "efficiency_if_not_overlapped_at_bound": 0.9, "serialised_allreduce_s": 0.5, "median_step_s": 2.0,
           "median_step_s_1host": 1.0, "comm_hidden_fraction": None, "tc": tc,
           "step_times_s": [1.2, 2.0, 1.2, 2.0]}
    old = {**row, "horovod_cycle_ms_effective": None, "accum": 1}
    del old["step_times_s"]
    data = {"commit": "abc", "command": "python bench/network/network.py", "load_before": [0.1], "steal_fraction": 0.01,
            "settings": {"steps": 4, "warmup": 2, "batch_size": 16, "max_length": 64}, "rows": [row, old],
            "one_host": [{"samples_per_s": 10.0, "step_times_s": [0.8, 1.0, 0.8, 1.0]}, {"samples_per_s": 10.0}]}
    new_line, old_line = [line for line in report.table(data) if line.startswith("| 1gbit")]
    assert "| 5 (facade's) |" in new_line and new_line.endswith("| 1.50 |")  # quiet micro-batches: 1.2 / 0.8
    assert "| 1 (Horovod's) |" in old_line and old_line.endswith("| – |")
