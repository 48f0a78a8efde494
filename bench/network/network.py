"""Scaling over a bandwidth-limited link: 2 hosts x 1 process against 1 host alone, per backend.

    python bench/network/network.py [--rates 10gbit,1gbit,200mbit] [--backends torch,accelerate,horovod]
                            [--compression none,bf16] [--bucket-mb default,4,100] [--accum 1] [--steps 10] [--warmup 2]
                            [--horovod-cycle-ms default,5,20] [--bucket-view on,off]
                            [--delay 0ms]
                            [--short] [--out FILE]

The two hosts are the network namespaces of tools/netns_hosts.sh (192.0.2.1 and 192.0.2.2 over
a veth pair named udnet0 on both sides), made for this run and removed in ``finally`` with
every process inside them, also when a run fails. Each link setting is a token bucket on
udnet0's egress in *both* namespaces (``tc qdisc add dev udnet0 root tbf rate R burst B
latency 50ms``; with ``--delay``, a netem qdisc with that delay in front of it, where the
kernel has netem); the qdiscs go with the namespaces, and are also deleted after each rate.

Per (rate, backend, compression) the 2-host job is started with the backend's own multi-node
line (unified_dist/testing/multinode.py's: torchrun's static rendezvous, accelerate launch's
two-machine line, horovodrun over ssh), running bench/network/network_worker.py. The 1-host baseline is
the same worker under plain python (one process, nothing sent) on the first host.

Every row of the results JSON (default bench/network/results/network[_short].json) has the commit, the
command lines, the exact tc settings, the load average, and: samples/s, scaling efficiency
(2-host samples/s / (2 x 1-host samples/s), against the 1-host run made just before that row: this
machine's speed drifts by 20 % within minutes, more than a row's differences), bytes on the wire
per step (both hosts' udnet0 tx counters over the timed steps), the bandwidth bound (a ring all-reduce of the gradient
bytes at that rate: 2(N-1)/N x bytes / rate, and the efficiency that time would allow if it
were not overlapped at all), and the overlap: with t1 the 1-host step (compute only), t2 the
2-host step and c a serialised all-reduce of the gradient's size measured in the same job,
hidden = (t1 + c - t2) / c (1: all communication hidden behind compute; 0: none).
``--accum A`` accumulates A micro-batches per optimizer step (``ud.init(gradient_accumulation_steps=A)``,
the one-host baseline too): one all-reduce per A micro-batches, and the per-step figures above
are then per optimizer step (A micro-batches; the mean, not the median, since the micro-batch
times alternate between with and without communication: the row's ``step_stat`` says which).
``--horovod-cycle-ms`` adds Horovod rows per background-thread cycle time (``HOROVOD_CYCLE_TIME``,
what ``horovodrun --cycle-time-ms`` sets; 'default' sets nothing, so the facade's CPU default
applies: unified_dist.backends.buckets.CPU_CYCLE_MS); other backends ignore it. Rows record the cycle
Horovod read (``horovod_cycle_ms_effective``).
``--bucket-view on,off`` adds torch and Accelerate rows with DDP's ``gradient_as_bucket_view`` on
(the facade's default) and off (``UNIFIED_DIST_BUCKET_VIEW=0``); Horovod ignores it.
``--compression bf16`` runs Horovod with fp16 (its only 16-bit compressor, see
:mod:`unified_dist.backends.compression`); each row records the format that ran.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "network" / "results"
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "shared")]

import provenance  # noqa: E402  (bench/shared/provenance.py)
from unified_dist.backends.buckets import HOROVOD_CYCLE_VAR as CYCLE_VAR  # noqa: E402
from unified_dist.settings import TABLE  # noqa: E402
from unified_dist.testing import multinode  # noqa: E402  (the hosts and the multi-node launch lines, as the tests')
from unified_dist.testing.launchers import BIN  # noqa: E402

BUCKET_VAR, VIEW_ENV = TABLE["bucket_mb"].variable, TABLE["bucket_view"].variable
COMPRESSION_VAR = TABLE["gradient_compression"].variable


WORKER = "bench/network/network_worker.py"
LAUNCH = {"torch": "torchrun-static", "accelerate": "accelerate", "horovod": "horovodrun"}
"""Each backend's two-host launch line in unified_dist/testing/multinode.py."""
SIXTEEN_BIT = {"horovod": "fp16"}
"""Where ``--compression bf16`` runs another 16-bit format: Horovod has no bf16 compressor."""
LAUNCH_TIMEOUT_S = 900


# ---------------------------------------------------------------------- link settings
def rate_bits(rate: str) -> float:
    """``"1gbit"`` -> 1e9 (tc's units: kbit, mbit, gbit; bits per second)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)?bit", rate.strip().lower())
    if not match:
        raise SystemExit(f"bench/network/network.py: rate {rate!r} is not tc's NUMBER[k|m|g]bit (e.g. 1gbit, 200mbit)")
    return float(match.group(1)) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]


def tc_commands(rate: str, delay: str, nic: str = multinode.NIC) -> List[List[str]]:
    """The tc lines that limit ``nic``'s egress to ``rate`` (and add ``delay``, if not 0).

    Burst: 2 ms at the rate, at least 64 KiB (256 kB at 1 Gbit/s, as the issue measured 958 Mbit/s
    through); below one timer tick's worth of bytes a token bucket cannot reach its rate.
    """
    burst = max(64 * 1024, int(rate_bits(rate) / 8 * 0.002))
    tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
    if delay in ("", "0", "0ms"):
        return [["tc", "qdisc", "add", "dev", nic, "root", *tbf]]
    return [["tc", "qdisc", "add", "dev", nic, "root", "handle", "1:", "netem", "delay", delay, "limit", "100000"],
            ["tc", "qdisc", "add", "dev", nic, "parent", "1:", "handle", "2:", *tbf]]


def limit_link(hosts: "multinode.Hosts", rate: str, delay: str) -> List[str]:
    """Apply :func:`tc_commands` in both namespaces; returns the lines applied (for the results)."""
    applied = []
    for name in hosts.names:
        clear_link(hosts, name)
        for cmd in tc_commands(rate, delay):
            done = subprocess.run(["ip", "netns", "exec", name, *cmd], capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                hint = " (this kernel has no netem: run with --delay 0ms)" if "netem" in cmd else ""
                raise RuntimeError(f"{' '.join(cmd)} in {name} failed: {done.stderr.strip()}{hint}")
            applied.append(f"ip netns exec {name} {' '.join(cmd)}")
    return applied


def clear_link(hosts: "multinode.Hosts", name: str) -> None:
    subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "del", "dev", hosts.nic, "root"],
                   capture_output=True, timeout=30)


# ---------------------------------------------------------------------- one job
def worker_args(out: Path, args: argparse.Namespace) -> List[str]:
    return [WORKER, "--out", str(out), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--comm-reps", str(args.comm_reps), "--batch-size", str(args.batch_size),
            "--max-length", str(args.max_length), "--accum", str(args.accum)]


def run_job(hosts, name: str, commands, out: Path) -> dict:
    """Run the per-host ``commands``; the worker's JSON plus the command lines and the job's wall time."""
    result = hosts.run(name, commands, LAUNCH_TIMEOUT_S)
    if result.timed_out or any(r.returncode != 0 for r in result.runs) or not out.exists():
        raise RuntimeError(f"{name} failed:\n{result.output(4000)}")
    data = json.loads(out.read_text())
    data["commands"] = [" ".join([*(f"{k}={v}" for k, v in extra.items() if k != "PATH"), *map(str, argv)])
                        for _, argv, extra in commands]
    data["job_wall_s"] = round(result.seconds, 1)
    return data


def baseline(hosts, args, tmp: Path) -> dict:
    """One process on the first host alone (plain python: backend ``single``, nothing sent).
    Made before every 2-host row, so each efficiency compares runs minutes, not half an hour, apart."""
    out = tmp / "network_1host.json"
    out.unlink(missing_ok=True)
    argv = [str(BIN / "python"), *worker_args(out, args)]
    return run_job(hosts, "1host", [(0, argv, {})], out)


def two_hosts(hosts, ssh, backend: str, compression: Optional[str], args, tmp: Path,
              bucket_mb: Optional[str] = None, cycle_ms: Optional[str] = None, bucket_view: bool = True) -> dict:
    fmt = SIXTEEN_BIT.get(backend, compression) if compression else None
    label = (f"{backend}-{fmt or 'none'}-{bucket_mb or 'default'}-{cycle_ms or 'default'}"
             f"-view{'on' if bucket_view else 'off'}")
    out = tmp / f"network_{label}.json"
    commands = multinode.launch_commands(LAUNCH[backend], hosts, "", [], ssh if backend == "horovod" else None)
    script = worker_args(out, args)
    env = {COMPRESSION_VAR: fmt} if fmt else {}
    if bucket_mb is not None:
        env[BUCKET_VAR] = bucket_mb
    if cycle_ms is not None:
        env[CYCLE_VAR] = cycle_ms
    if not bucket_view:
        env[VIEW_ENV] = "0"
    # launch_commands ends each line with the script and its arguments: put ours there
    commands = [(host, [*argv[:-1], *script], {**extra, **env}) for host, argv, extra in commands]
    job = run_job(hosts, label, commands, out)
    job["bucket_mb"], job["horovod_cycle_ms"], job["bucket_view"] = bucket_mb, cycle_ms, bucket_view
    return job


def quiet_ratio(job: dict, one_host: dict) -> Optional[float]:
    """With accumulation: the median micro-batch that sends nothing (all but every k-th) on 2 hosts
    over the same on 1 host. Above 1 is compute slowed by something other than the link: the
    other host's process on the shared CPU, a communication thread's wake-ups. None without accumulation."""
    k = job.get("accum", 1)
    if k == 1:
        return None

    def quiet(times: List[float]) -> float:
        return statistics.median(t for i, t in enumerate(times) if i % k != k - 1)
    return quiet(job["step_times_s"]) / quiet(one_host["step_times_s"])


def summarise(job: dict, one_host: dict, rate: str, delay: str, tc: List[str]) -> dict:
    """One results row: throughput, efficiency, wire bytes, the bandwidth bound, the overlap."""
    n, k = job["world_size"], job.get("accum", 1)
    elem = {None: 4, "bf16": 2, "fp16": 2}[job["compression"]]
    grad_bytes = job["grad_numel"] * elem
    bound_s = 2 * (n - 1) / n * grad_bytes / (rate_bits(rate) / 8)
    # per optimizer step; with accumulation the micro-batch times alternate, so their mean
    t1, t2 = ((one_host["median_step_s"], job["median_step_s"]) if k == 1
              else (k * one_host["mean_step_s"], k * job["mean_step_s"]))
    comm = job["serialised_allreduce_s"]
    return {
        "backend": job["backend"], "launcher": job["launcher"], "rate": rate, "delay": delay,
        "compression": job["compression"], "compression_per_rank": job["compression_per_rank"],
        "bucket_mb": job.get("bucket_mb"),  # None: the stack's own (DDP 25 MiB, Horovod 128 MiB fusion buffer)
        "horovod_cycle_ms": job.get("horovod_cycle_ms"),  # None: not set by the benchmark
        "horovod_cycle_ms_effective": job.get("horovod_cycle_time"),  # what hvd.init() read (None: not Horovod)
        "bucket_view": job.get("bucket_view", True),  # DDP's gradient_as_bucket_view (torch, Accelerate)
        "accum": k,  # micro-batches per optimizer step (one all-reduce each); step figures are per optimizer step
        "step_stat": "median" if k == 1 else "mean",  # what median_step_s(_1host) holds (see the module doc)
        "tc": tc, "commands": job["commands"],
        "samples_per_s": job["samples_per_s"], "samples_per_s_1host": one_host["samples_per_s"],
        "one_host_job_wall_s": one_host.get("job_wall_s"),
        "efficiency": job["samples_per_s"] / (n * one_host["samples_per_s"]),
        "median_step_s": t2, "median_step_s_1host": t1,
        "wire_bytes_per_step": job["wire_bytes_per_step"], "grad_bytes": grad_bytes,
        "ring_allreduce_bound_s": bound_s,
        "efficiency_if_not_overlapped_at_bound": t1 / (t1 + bound_s),
        "serialised_allreduce_s": comm,
        "comm_hidden_fraction": (t1 + comm - t2) / comm if comm > 0 else None,
        "quiet_microbatch_ratio": quiet_ratio(job, one_host),
        "steps": job["steps"], "warmup": job["warmup"], "batch_size": job["batch_size"],
        "max_length": job["max_length"], "job_wall_s": job["job_wall_s"],
        "step_times_s": job["step_times_s"],  # rank 0's, per micro-batch (the 1-host run's are in one_host)
    }


# ---------------------------------------------------------------------- the run
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="10gbit,1gbit,200mbit")
    p.add_argument("--backends", default="torch,accelerate,horovod")
    p.add_argument("--compression", default="none,bf16", help="none and/or bf16 (Horovod: fp16)")
    p.add_argument("--bucket-mb", default="default",
                   help="comma-separated MiB per fused reduction (UNIFIED_DIST_BUCKET_MB), "
                        "'default' for the stack's own")
    p.add_argument("--accum", type=int, default=1,
                   help="micro-batches per optimizer step (gradient_accumulation_steps; "
                        "--steps/--warmup count micro-batches)")
    p.add_argument("--horovod-cycle-ms", default="default",
                   help="comma-separated Horovod cycle times in ms (HOROVOD_CYCLE_TIME), 'default' for the facade's")
    p.add_argument("--bucket-view", default="on",
                   help="on and/or off: DDP's gradient_as_bucket_view (torch, Accelerate)")
    p.add_argument("--delay", default="0ms", help="netem delay added on each side (needs netem in the kernel)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--comm-reps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--short", action="store_true", help="make bench: 1gbit, torch, none and bf16, 3 steps")
    p.add_argument("--out", help="results JSON (default bench/network/results/network[_short].json)")
    args = p.parse_args()
    if args.short:
        args.rates, args.backends, args.compression, args.steps, args.warmup, args.comm_reps = \
            "1gbit", "torch", "none,bf16", 3, 1, 1
    return args


def main() -> int:
    args = parse_args()
    # SIGTERM (a timeout, a CI cancel) unwinds through the finally below, which removes the hosts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    reason = multinode.cannot_make_namespaces()
    if reason:
        print(f"bench/network/network.py: skipped, cannot make the two namespace hosts: {reason}", file=sys.stderr)
        return 0 if args.short else 1
    out = Path(args.out) if args.out else RESULTS / f"network{'_short' if args.short else ''}.json"
    record = {**provenance.start(), "settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": []}
    tmp = Path(tempfile.mkdtemp(prefix="ud-net-"))
    hosts = multinode.Hosts(f"{os.getpid()}-{secrets.token_hex(2)}", tmp)
    ssh = None
    started = time.monotonic()
    try:
        up = subprocess.run([str(multinode.NETNS_SCRIPT), "up", hosts.suffix], capture_output=True, text=True,
                            timeout=120)
        if up.returncode != 0:
            raise RuntimeError(f"tools/netns_hosts.sh up failed: {up.stderr.strip()}")
        backends = args.backends.split(",")
        if "horovod" in backends:
            sshd = "/usr/sbin/sshd" if os.access("/usr/sbin/sshd", os.X_OK) else shutil.which("sshd")
            ssh = multinode.start_sshd(hosts, tmp, sshd, shutil.which("ssh"))
        record["one_host"] = []  # one baseline per row, in row order
        for rate in args.rates.split(","):
            tc = limit_link(hosts, rate, args.delay)
            for backend in backends:
                cycles = args.horovod_cycle_ms.split(",") if backend == "horovod" else ["default"]
                views = ["on"] if backend == "horovod" else args.bucket_view.split(",")
                for compression, bucket, cycle, view in itertools.product(args.compression.split(","),
                                                                          args.bucket_mb.split(","), cycles, views):
                    one_host = baseline(hosts, args, tmp)
                    record["one_host"].append(one_host)
                    job = two_hosts(hosts, ssh, backend, None if compression == "none" else compression, args, tmp,
                                    None if bucket == "default" else bucket, None if cycle == "default" else cycle,
                                    view == "on")
                    row = summarise(job, one_host, rate, args.delay, tc)
                    record["rows"].append(row)
                    hidden = row["comm_hidden_fraction"]
                    print(f"{rate:>8} {backend:<10} {row['compression'] or 'none':<5} bucket {bucket:>7} "
                          f"cycle {cycle:>7} view {view:>3} accum {row['accum']} "
                          f"{row['samples_per_s']:6.2f} samples/s  efficiency {row['efficiency']:.2f}  "
                          f"{row['wire_bytes_per_step'] / 1e6:7.1f} MB/step on the wire  bound "
                          f"{row['ring_allreduce_bound_s']:.2f} s  serialised all-reduce "
                          f"{row['serialised_allreduce_s']:.2f} s  step {row['median_step_s']:.2f} s "
                          f"(1 host {row['median_step_s_1host']:.2f} s)  hidden "
                          f"{hidden if hidden is None else round(hidden, 2)}",
                          flush=True)
                    out.parent.mkdir(parents=True, exist_ok=True)  # partial results survive a later failure
                    out.write_text(json.dumps(provenance.finish(dict(record)), indent=1))
            for name in hosts.names:
                clear_link(hosts, name)
    finally:
        if ssh is not None:
            multinode.kill_group(ssh.sshd)
        hosts.down()  # kills everything inside, deletes both namespaces with their veth and qdiscs
        shutil.rmtree(tmp, ignore_errors=True)
    record["wall_s"] = round(time.monotonic() - started, 1)
    out.write_text(json.dumps(provenance.finish(record), indent=1))
    print(f"wrote {out} ({record['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
