"""``unified-dist launch --gradient-compression`` hands the format to the script in its environment."""
from unified_dist.settings import TABLE

ENV_VAR = TABLE["gradient_compression"].variable


def test_cli_flag(cli, tmp_path):
    (tmp_path / "train.py").write_text("raise SystemExit('a dry run must not run the script')\n")
    result = cli("launch", "--dry-run", "--backend", "torch", "--gradient-compression", "fp16", "train.py",
                 cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{ENV_VAR}=fp16 torchrun "), result.stdout
