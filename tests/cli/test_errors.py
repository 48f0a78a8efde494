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
