"""``unified-dist env``: text and JSON reports, Horovod's build, detection, and fixes for what is broken.

The text report and the broken backends run the console command in a fresh interpreter (``cli``); the reports under
given variables call its ``main`` in this process (``cli_in_process``): the command reads the variables when it
runs, and its first call's imports (torch, the backends: about 4 s) are then paid once, not once per report."""
import json
import re

KEYS = {"python", "packages", "backends", "horovod_build", "hardware", "detection", "settings",
        "unknown_settings", "problems"}
PACKAGES = {"unified_dist", "torch", "accelerate", "horovod", "deepspeed", "transformers", "datasets"}


def test_text_report_has_every_section(cli):
    result = cli("env")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for heading in ("versions", "backends", "horovod build", "hardware", "this environment would run", "settings",
                    "problems"):
        assert f"\n{heading}" in f"\n{text}", heading
    for package in PACKAGES:
        assert f"\n  {package} " in text, package
    assert "  backend       single" in text and "  launcher      python" in text
    assert "no launcher variables" in text


def test_json_report_keys_and_detection_under_torchrun_variables(cli_in_process):
    env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
           "UNIFIED_DIST_MIXED_PRECISION": "bf16"}
    result = cli_in_process("env", "--json", env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == KEYS
    assert set(report["packages"]) == PACKAGES and report["packages"]["torch"].startswith("2.")
    assert {"torch", "accelerate", "horovod", "single"} <= set(report["backends"])
    assert report["backends"]["torch"]["ok"] and report["backends"]["torch"]["launcher"].endswith("torchrun")
    assert report["hardware"]["cpu_count"] >= 1 and isinstance(report["hardware"]["gpus"], list)
    found = report["detection"]
    assert (found["backend"], found["launcher"], found["world_size"], found["rank"]) == ("torch", "torchrun", 2, 1)
    assert "TORCHELASTIC_RUN_ID" in found["reason"] and found["mixed_precision"] == "bf16"


def test_json_report_horovod_built_with_gloo(cli_in_process):
    report = json.loads(cli_in_process("env", "--json").stdout)
    assert report["backends"]["horovod"]["ok"], report["backends"]["horovod"]
    build = report["horovod_build"]
    assert build["frameworks"]["PyTorch"] and build["controllers"]["Gloo"] and build["tensor_operations"]["Gloo"]
    assert not build["controllers"]["MPI"]  # built with HOROVOD_WITHOUT_MPI=1


def test_broken_backends_are_reported_with_their_fix(cli):
    code = ("import sys; sys.modules['accelerate'] = None; sys.modules['horovod.torch'] = None\n"
            "from unified_dist.cli.main import main; sys.exit(main(sys.argv[1:]))")
    result = cli("env", "--json", code=code)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    accelerate, horovod = report["backends"]["accelerate"], report["backends"]["horovod"]
    assert not accelerate["ok"] and "pip install unified_dist[accelerate]" in accelerate["fix"]
    assert not horovod["ok"] and "make setup" in horovod["fix"] and "tools/build_horovod.sh" in horovod["fix"]
    assert report["horovod_build"] is None
    assert any(p.startswith("accelerate:") for p in report["problems"])
    text = cli("env", code=code).stdout
    assert "BROKEN" in text and "fix: build it against this torch with `make setup`" in text


def test_half_configured_launch_is_reported_as_a_problem(cli_in_process):
    report = json.loads(cli_in_process("env", "--json", env={"RANK": "1"}).stdout)
    assert report["detection"]["backend"] == "single"
    assert any("RANK set but WORLD_SIZE missing" in p for p in report["detection"]["problems"])
    assert any(p.startswith("detection: RANK set") and "start with torchrun" in p for p in report["problems"])


def test_srun_task_is_reported_with_its_derived_rendezvous(cli_in_process):
    env = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
           "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "vm"}
    report = json.loads(cli_in_process("env", "--json", env=env).stdout)
    found = report["detection"]
    assert (found["backend"], found["launcher"], found["world_size"], found["rank"]) == ("torch", "srun", 2, 1)
    assert found["rendezvous"].startswith("127.0.0.1:") and not found["problems"]
    text = cli_in_process("env", env=env).stdout
    assert "  launcher      srun" in text and "  rendezvous    127.0.0.1:" in text


def test_a_misspelled_setting_is_a_problem_and_the_settings_in_effect_are_listed(cli_in_process):
    env = {"UNIFIED_DIST_SYNCBATCHNORM": "1", "UNIFIED_DIST_BUCKET_MB": "4"}
    text = cli_in_process("env", env=env).stdout
    problem = ("settings: UNIFIED_DIST_SYNCBATCHNORM is not a unified_dist setting and is ignored; "
               "did you mean UNIFIED_DIST_SYNC_BATCHNORM?")
    # other problems (a venv without Horovod) may come first
    listed = text.split("\nproblems\n", 1)[1].split("\n\n", 1)[0]
    assert f"  {problem}" in listed.splitlines(), text
    assert re.search(r"\n  UNIFIED_DIST_BUCKET_MB +4 \(environment\)\n", text), text
    assert re.search(r"\n  UNIFIED_DIST_SYNC_BATCHNORM +off \(default\)\n", text), text
    report = json.loads(cli_in_process("env", "--json", env=env).stdout)
    assert report["unknown_settings"] == [{"variable": "UNIFIED_DIST_SYNCBATCHNORM",
                                           "suggestion": "UNIFIED_DIST_SYNC_BATCHNORM"}]
    assert problem in report["problems"]
    rows = {row["variable"]: row for row in report["settings"]}
    assert (rows["UNIFIED_DIST_BUCKET_MB"]["value"], rows["UNIFIED_DIST_BUCKET_MB"]["source"]) == ("4", "environment")
    assert rows["UNIFIED_DIST_SYNC_BATCHNORM"]["source"] == "default"
    assert rows["UNIFIED_DIST_SYNC_BATCHNORM"]["keyword"] == "sync_batchnorm"


def test_a_value_that_does_not_read_is_a_problem_init_would_refuse(cli_in_process):
    text = cli_in_process("env", env={"UNIFIED_DIST_SYNC_BATCHNORM": "maybe"}).stdout
    assert ("\n  settings: UNIFIED_DIST_SYNC_BATCHNORM='maybe' is neither on nor off; use 1, true, yes, on or 0, "
            "false, no, off (any case) (ud.init() refuses to start here)\n") in text, text
