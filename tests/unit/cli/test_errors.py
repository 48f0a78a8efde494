"""Every usage error of ``unified-dist``: one line on stderr, exit status 2, nothing run."""
import pytest

CASES = [
    ("unknown launch backend", ["launch", "--backend", "nccl", "train.py"], "invalid choice: 'nccl'"),
    ("unknown test backend", ["test", "--backend", "torch,nccl"], "unknown backend 'nccl'"),
    ("nproc below 1", ["launch", "--backend", "torch", "--nproc", "0", "train.py"], "--nproc must be at least 1"),
    ("test nproc below 1", ["test", "--nproc", "0"], "--nproc must be at least 1"),
    ("missing script", ["launch", "--backend", "torch", "--nproc", "2", "missing.py"], "'missing.py' does not exist"),
    ("not an integer", ["launch", "--backend", "torch", "--nproc", "two", "train.py"], "invalid int value: 'two'"),
    ("no subcommand", [], "required"),
    ("multi-node torch without address", ["launch", "--backend", "torch", "--nnodes", "2", "train.py"],
     "needs --master-addr"),
    ("multi-node horovod without hosts", ["launch", "--backend", "horovod", "--nnodes", "2", "train.py"],
     "needs --hosts"),
]


@pytest.mark.parametrize("args,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_usage_error_is_one_line_exit_2(cli, tmp_path, args, expected):
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    result = cli(*args, cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("unified-dist"), result.stderr
    assert "error:" in result.stderr and expected in result.stderr, result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("backend,launcher,fix", [
    ("torch", "torchrun", "make setup"),
    ("accelerate", "accelerate", "pip install unified_dist[accelerate]"),
    ("horovod", "horovodrun", "tools/build_horovod.sh"),
])
def test_launcher_not_installed_names_the_fix(cli, tmp_path, backend, launcher, fix):
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    code = ("import shutil, sys\nfound = shutil.which\n"
            f"shutil.which = lambda name, *a, **k: None if name == {launcher!r} else found(name, *a, **k)\n"
            "from unified_dist.cli.main import main; sys.exit(main(sys.argv[1:]))")
    result = cli("launch", "--backend", backend, "--nproc", "2", "train.py", cwd=tmp_path, code=code)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"{launcher} (the {backend} launcher) is not installed" in result.stderr and fix in result.stderr


def test_fp16_without_cuda_is_refused_as_init_refuses_it(cli, tmp_path):
    import torch

    (tmp_path / "x.py").write_text("raise SystemExit('must not run')\n")
    result = cli("launch", "--dry-run", "--backend", "torch", "--nproc", "2", "--mixed-precision", "fp16", "x.py",
                 cwd=tmp_path)
    if torch.cuda.is_available():  # the premise (no CUDA GPU) does not hold: fp16 is allowed here
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("UNIFIED_DIST_MIXED_PRECISION=fp16 torchrun "), result.stdout
        return
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and result.stdout == "", result.stderr
    assert result.stderr.startswith("unified-dist launch: error: fp16 mixed precision needs a CUDA GPU;"), result.stderr
    assert "use --mixed-precision bf16" in result.stderr, result.stderr


def test_launch_refuses_fp16_by_the_rule_init_applies():
    from unified_dist.cli.errors import UsageError
    from unified_dist.cli.launch import Plan, check_precision
    from unified_dist.errors import PrecisionError
    from unified_dist.session import config_from

    plan = Plan(backend="torch", script="x.py", settings={"mixed_precision": "fp16"})
    check_precision(plan, cuda=True)
    check_precision(Plan(backend="torch", script="x.py", settings={"mixed_precision": "bf16"}), cuda=False)
    check_precision(Plan(backend="torch", script="x.py"), cuda=False)
    with pytest.raises(UsageError) as refused:
        check_precision(plan, cuda=False)
    with pytest.raises(PrecisionError) as init_refused:
        config_from({"mixed_precision": "fp16"}, {}, cuda=False)
    assert str(init_refused.value).replace("mixed_precision='bf16'", "--mixed-precision bf16") == str(refused.value)
