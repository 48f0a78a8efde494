"""``unified-dist launch``: the exact native command per backend, and real 2-process launches."""
import json
import shlex
import subprocess

import pytest

from unified_dist.testing.launchers import child_env

SINGLE = {
    "torch": "torchrun --standalone --nproc_per_node 2 train.py --lr 3",
    "accelerate": ("accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no "
                   "--dynamo_backend no train.py --lr 3"),
    "horovod": "horovodrun -np 2 -H localhost:2 --gloo python train.py --lr 3",
}
MULTI_NODE = {
    "torch": (["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "1234"],
              "UNIFIED_DIST_MIXED_PRECISION=bf16 torchrun --nnodes 2 --node_rank 1 --nproc_per_node 2 "
              "--master_addr 10.0.0.1 --master_port 1234 train.py 'two words'"),
    "accelerate": (["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "1234"],
                   "accelerate launch --multi_gpu --num_processes 4 --num_machines 2 --machine_rank 1 "
                   "--main_process_ip 10.0.0.1 --main_process_port 1234 --mixed_precision bf16 "
                   "--dynamo_backend no train.py 'two words'"),
    "horovod": (["--hosts", "10.0.0.1:2,10.0.0.2:2", "--network-interface", "eth0"],
                "UNIFIED_DIST_MIXED_PRECISION=bf16 horovodrun -np 4 -H 10.0.0.1:2,10.0.0.2:2 --gloo "
                "--network-interface eth0 python train.py 'two words'"),
}


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "train.py").write_text("raise SystemExit('a dry run must not run the script')\n")
    return tmp_path


def _dry_run(cli, cwd, *args):
    """``unified-dist launch --dry-run ARGS``, in this process (``cli_in_process``): the one line it prints."""
    result = cli("launch", "--dry-run", *args, cwd=cwd)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1, result.stdout
    return result.stdout.strip()


@pytest.mark.parametrize("backend", list(SINGLE))
def test_dry_run_single_node(cli_in_process, workdir, backend):
    assert (_dry_run(cli_in_process, workdir, "--backend", backend, "--nproc", "2", "train.py", "--lr", "3")
            == SINGLE[backend])


@pytest.mark.parametrize("backend", list(MULTI_NODE))
def test_dry_run_multi_node(cli_in_process, workdir, backend):
    flags, expected = MULTI_NODE[backend]
    line = _dry_run(cli_in_process, workdir, "--backend", backend, "--nproc", "2", *flags, "--mixed-precision", "bf16",
                    "train.py", "two words")
    assert line == expected


ACCELERATE_API = {
    "torch": "torchrun --standalone --nproc_per_node 2 -m unified_dist.accelerate train.py train.py --lr 3",
    "accelerate": ("accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no "
                   "--dynamo_backend no -m unified_dist.accelerate train.py train.py --lr 3"),
    "horovod": "horovodrun -np 2 -H localhost:2 --gloo python -m unified_dist.accelerate train.py train.py --lr 3",
}


@pytest.mark.parametrize("backend", list(ACCELERATE_API))
def test_accelerate_api_runs_the_script_through_the_runner(cli_in_process, workdir, backend):
    """Issue #51: ``--accelerate-api`` puts ``-m unified_dist.accelerate`` (torchrun's and ``accelerate launch``'s own
    flag, the interpreter's under horovodrun) right before the script, never before an argument that repeats its
    name. Real launches: tests/launchers/test_trainer_family.py (accelerate, horovod)."""
    line = _dry_run(cli_in_process, workdir, "--backend", backend, "--nproc", "2", "--accelerate-api",
                    "train.py", "train.py", "--lr", "3")
    assert line == ACCELERATE_API[backend]


def test_accelerate_api_and_horovod_api_are_refused_together(cli_in_process, workdir):
    result = cli_in_process("launch", "--dry-run", "--backend", "torch", "--accelerate-api", "--horovod-api",
                            "train.py", cwd=workdir)
    assert result.returncode != 0 and "not allowed with argument" in result.stderr


def test_dry_run_accelerate_one_process_is_not_multi_gpu(cli_in_process, workdir):
    line = _dry_run(cli_in_process, workdir, "--backend", "accelerate", "train.py")
    assert line == ("accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no "
                    "--dynamo_backend no train.py")


WORKER = """
import json, os, sys
import unified_dist as ud
ud.init()
with open(os.path.join(sys.argv[1], f"rank{ud.rank()}.json"), "w") as f:
    json.dump({"rank": ud.rank(), "world_size": ud.world_size(), "backend": ud.backend_name(),
               "launcher": ud.launcher(), "mixed_precision": ud.mixed_precision()}, f)
ud.barrier()
ud.shutdown()
"""


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("backend,launcher", [("torch", "torchrun"), ("accelerate", "accelerate"),
                                              ("horovod", "horovodrun")])
def test_real_launch_two_ranks_with_bf16(cli, tmp_path, backend, launcher):
    (tmp_path / "worker.py").write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    result = cli("launch", "--backend", backend, "--nproc", "2", "--mixed-precision", "bf16", "worker.py", str(out),
                 cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    printed = result.stderr.splitlines()[0]
    assert printed.startswith("+ ") and f" {launcher} " in f" {printed[2:]}", printed
    ranks = sorted(json.loads(p.read_text())["rank"] for p in out.glob("rank*.json"))
    assert ranks == [0, 1], result.stdout + result.stderr
    for path in out.glob("rank*.json"):
        data = json.loads(path.read_text())
        assert (data["world_size"], data["backend"], data["launcher"], data["mixed_precision"]) == \
            (2, backend, launcher, "bf16"), data


@pytest.mark.distributed
def test_exit_status_is_the_launchers_and_the_printed_command_runs_the_same_horovod(cli, tmp_path):
    (tmp_path / "fail.py").write_text("import sys; sys.exit(3)\n")
    result = cli("launch", "--backend", "horovod", "--nproc", "1", "fail.py", cwd=tmp_path, timeout=60)
    printed = result.stderr.splitlines()[0]
    assert printed == "+ horovodrun -np 1 -H localhost:1 --gloo python fail.py", printed
    native = subprocess.run(shlex.split(printed[2:]), cwd=tmp_path, env=child_env(), capture_output=True, timeout=60)
    assert result.returncode == native.returncode != 0, (result.returncode, native.returncode)


@pytest.mark.parametrize("backend", ["torch", "accelerate"])
def test_sharding_and_sync_batchnorm_reach_the_script_as_variables(backend):
    from unified_dist.cli.launch import Plan, build

    command = build(Plan(backend=backend, script="train.py", nproc=2,
                         settings={"sharding": "fsdp", "sync_batchnorm": True}),
                    cuda=False, environ={})
    assert command.env["UNIFIED_DIST_SHARDING"] == "fsdp" and command.env["UNIFIED_DIST_SYNC_BATCHNORM"] == "1"
    assert command.line().startswith("UNIFIED_DIST_SHARDING=fsdp UNIFIED_DIST_SYNC_BATCHNORM=1 ")


def test_sharding_under_horovod_is_refused_before_anything_starts():
    from unified_dist.cli.errors import UsageError
    from unified_dist.cli.launch import Plan, build

    for settings, flag in (({"sharding": "fsdp"}, "--sharding fsdp"), ({"tp": 2}, "--tp 2"),
                           ({"dp_replicate": "nodes"}, "--dp-replicate nodes")):
        with pytest.raises(UsageError, match=f"^{flag}: horovod has no sharding or tensor parallelism; "
                                             "use --backend torch or accelerate$"):
            build(Plan(backend="horovod", script="train.py", nproc=2, settings=settings), cuda=False, environ={})


def test_network_interface_pins_gloo_for_torch_and_accelerate():
    """docs/cli.md: --network-interface sets GLOO_SOCKET_IFNAME for torch and Accelerate (NCCL's only on CUDA)."""
    from unified_dist.cli.launch import Plan, build
    for backend in ("torch", "accelerate"):
        command = build(Plan(backend=backend, script="train.py", nproc=4, nnodes=2, node_rank=1,
                             master_addr="192.0.2.1", master_port=29500, network_interface="eth0"),
                        cuda=False, environ={})
        assert command.env["GLOO_SOCKET_IFNAME"] == "eth0" and "NCCL_SOCKET_IFNAME" not in command.env
        assert command.line().startswith("GLOO_SOCKET_IFNAME=eth0 "), command.line()


def test_the_launcher_runs_with_this_interpreters_bin_first_on_path():
    """docs/cli.md: the launcher runs with this interpreter's bin/ first on PATH (horovodrun starts `python`)."""
    import os
    import sys

    from unified_dist.cli import launch
    from unified_dist.cli.launch import Plan, build
    command = build(Plan(backend="horovod", script="train.py", nproc=2), cuda=False, environ={})
    path = launch.environment(command, {"PATH": "/usr/bin"})["PATH"]
    assert path.split(os.pathsep)[0] == os.path.dirname(sys.executable), path


def test_the_launcher_refuses_replica_groups_for_other_backends_and_several_hosts(cli_in_process, tmp_path):
    (tmp_path / "train.py").write_text("")
    for args, words in ((["--backend", "accelerate"], "runs the torch backend's groups"),
                        (["--backend", "torch", "--nnodes", "2", "--master-addr", "a"], "one host")):
        result = cli_in_process("launch", "--replica-groups", "2", *args, "train.py", cwd=tmp_path)
        assert result.returncode != 0 and words in result.stderr


def test_the_launcher_dry_run_prints_every_groups_command(cli_in_process, tmp_path):
    (tmp_path / "train.py").write_text("")
    result = cli_in_process("launch", "--dry-run", "--backend", "torch", "--nproc", "2", "--replica-groups", "2",
                            "train.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and "REPLICA_GROUP_ID=0" in lines[1] and "REPLICA_GROUP_ID=1" in lines[2]
    assert all("torchrun --standalone --nproc_per_node 2 train.py" in line for line in lines[1:])


# ------------------------------------------------------------------------------ no torch to ask for a GPU
@pytest.mark.fresh_python  # a fork of the zygote has torch in memory before its first line
def test_where_no_gpu_driver_is_present_the_launcher_never_imports_torch(workdir):
    """A GPU is reached through its driver's device files (NVIDIA's, ROCm's, WSL 2's); where none exists the
    launcher answers without torch's import (2-3 CPU-seconds of every launch), for every backend and for replica
    groups. The device files are pointed elsewhere, so a GPU machine checks the same path."""
    import sys

    program = (
        "import sys\n"
        "from unified_dist.cli import launch\n"
        "from unified_dist.cli.main import main\n"
        "launch.GPU_DEVICE_FILES = ('/nonexistent/nvidiactl',)\n"
        "for args in (['--backend', b] for b in ('torch', 'accelerate', 'horovod', 'deepspeed')):\n"
        "    assert main(['launch', '--dry-run', '--nproc', '2', *args, 'train.py']) == 0\n"
        "assert main(['launch', '--dry-run', '--replica-groups', '2', 'train.py']) == 0\n"
        "print('torch imported:', 'torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", program], cwd=workdir, env=child_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "torch imported: False", result.stdout


def test_where_a_gpu_driver_is_present_torch_counts_the_gpus(tmp_path, monkeypatch):
    import torch

    from unified_dist.cli import launch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(launch, "GPU_DEVICE_FILES", (str(tmp_path / "nvidiactl"),))
    assert launch.gpu_count() == 0  # no driver: torch is not asked
    (tmp_path / "nvidiactl").touch()
    assert launch.gpu_count() == 3
