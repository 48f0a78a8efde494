"""unified_dist.settings: every UNIFIED_DIST_* variable is declared once, and a name outside that
table (a misspelling) is reported with the closest declared one."""
import inspect
import re
import warnings
from pathlib import Path

import pytest

import unified_dist as ud
from unified_dist import settings
from unified_dist.errors import SettingError
from unified_dist.settings import SETTINGS, TABLE, in_effect, unknown_variables, warn_unknown
from unified_dist.testing.launchers import ROOT

SCANNED = ("unified_dist", "examples", "tools", "bench", "Makefile")
"""Where the variables are read: the library, its examples, tools and benchmarks, the Makefile (not the
results folders, bench/<topic>/results/ and tools/mutants/results/, nor the version matrix's rows: recorded output,
which may quote a misspelled name a test ran)."""
RECORDED = ("tools/versions/versions.json",)
LITERAL = re.compile(r"UNIFIED_DIST_[A-Z_]+")


def literals(root: Path):
    """Every ``UNIFIED_DIST_*`` name spelled anywhere under ``root``'s scanned paths."""
    found = set()
    for top in SCANNED:
        path = root / top
        files = ([path] if path.is_file()
                 else [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                       and "results" not in p.relative_to(root).parts[:-1]
                       and p.relative_to(root).as_posix() not in RECORDED])
        for file in files:
            found.update(LITERAL.findall(file.read_text(errors="ignore")))
    return found


def test_every_variable_the_repository_spells_is_declared():
    assert literals(ROOT) - set(SETTINGS) == set()
    assert set(SETTINGS) <= literals(ROOT)  # and nothing declared that nobody reads


def test_the_scan_would_catch_a_new_variable(tmp_path):
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "new.sh").write_text('echo "${UNIFIED_DIST_BRAND_NEW:-0}" "$UNIFIED_DIST_DEBUG"\n')
    (tmp_path / "Makefile").write_text("x:\n\tUNIFIED_DIST_OTHER=1 true\n")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "run.json").write_text('{"tail": "UNIFIED_DIST_QUOTED=1"}')
    (tmp_path / "bench" / "new.py").write_text('os.environ.get("UNIFIED_DIST_BENCH_NEW")\n')
    expected = {"UNIFIED_DIST_BRAND_NEW", "UNIFIED_DIST_OTHER", "UNIFIED_DIST_BENCH_NEW"}
    assert literals(tmp_path) - set(SETTINGS) == expected


def test_a_misspelling_gets_the_closest_name():
    environ = {"UNIFIED_DIST_SYNCBATCHNORM": "1", "UNIFIED_DIST_MIXED_PRECISON": "bf16",
               "unified_dist_debug": "1", "UNIFIED_DIST_XYZZY": "1"}
    assert unknown_variables(environ) == [("UNIFIED_DIST_MIXED_PRECISON", "UNIFIED_DIST_MIXED_PRECISION"),
                                          ("UNIFIED_DIST_SYNCBATCHNORM", "UNIFIED_DIST_SYNC_BATCHNORM"),
                                          ("UNIFIED_DIST_XYZZY", None),
                                          ("unified_dist_debug", "UNIFIED_DIST_DEBUG")]


def test_known_names_and_other_variables_are_not_reported():
    environ = {name: "1" for name in SETTINGS}
    environ.update(PATH="/bin", SYNC_BATCHNORM="1", MY_UNIFIED_DIST_THING="1", RANK="0")
    assert unknown_variables(environ) == []
    assert unknown_variables({}) == []


def test_warn_unknown_warns_once_per_name(monkeypatch):
    monkeypatch.setattr(settings, "_warned", set())
    environ = {"UNIFIED_DIST_SYNCBATCHNORM": "1", "UNIFIED_DIST_DEBUG": "1"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = warn_unknown(environ)
        second = warn_unknown(environ)
    assert first == second == [("UNIFIED_DIST_SYNCBATCHNORM", "UNIFIED_DIST_SYNC_BATCHNORM")]
    assert len(caught) == 1 and caught[0].category is UserWarning
    message = str(caught[0].message)
    assert "UNIFIED_DIST_SYNCBATCHNORM" in message and "did you mean UNIFIED_DIST_SYNC_BATCHNORM?" in message
    with pytest.warns(UserWarning, match="UNIFIED_DIST_BUCKETMB"):  # a name not seen before still warns
        warn_unknown({**environ, "UNIFIED_DIST_BUCKETMB": "4"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_unknown({"UNIFIED_DIST_DEBUG": "1"}) == []


def test_settings_in_effect_say_where_each_value_came_from():
    rows = {row["variable"]: row for row in in_effect({"UNIFIED_DIST_MIXED_PRECISION": "bf16",
                                                       "UNIFIED_DIST_DEBUG": "maybe"})}
    assert list(rows) == list(SETTINGS)
    assert rows["UNIFIED_DIST_MIXED_PRECISION"] == {
        "variable": "UNIFIED_DIST_MIXED_PRECISION", "value": "bf16", "source": "environment",
        "keyword": "mixed_precision", "flag": "--mixed-precision", "accepted": "no | bf16 | fp16",
        "help": SETTINGS["UNIFIED_DIST_MIXED_PRECISION"].help, "problem": None}
    assert (rows["UNIFIED_DIST_TIMEOUT"]["value"], rows["UNIFIED_DIST_TIMEOUT"]["source"]) == ("600", "default")
    assert rows["UNIFIED_DIST_DEBUG"]["problem"].startswith("UNIFIED_DIST_DEBUG='maybe' is neither on nor off")
    assert (rows["UNIFIED_DIST_SLURM"]["keyword"], rows["UNIFIED_DIST_SLURM"]["flag"]) == (None, None)


# ---------------------------------------------------------------------- one table, everything derived
def test_init_config_and_launch_name_exactly_the_tables_settings():
    """init's keywords, Config's fields and unified-dist launch's flags come from the table: a
    setting added to one and not the others fails here."""
    import argparse
    import dataclasses

    from unified_dist import facade
    from unified_dist.backends.base import Config
    from unified_dist.cli import launch

    keywords = [p for p in inspect.signature(facade.init).parameters if p != "backend"]
    assert keywords == [n for n in TABLE if TABLE[n].keyword and n != "backend"]
    assert all(inspect.signature(facade.init).parameters[k].default is None for k in keywords)
    fields = {f.name for f in dataclasses.fields(Config)}
    sharding = {"shard_modules", "reshard_after_forward", "dp_replicate", "tp", "tp_plan", "cpu_offload",
                "activation_checkpointing", "pp", "pp_schedule", "pp_microbatches", "pp_split"}  # in Config.sharding
    assert fields | sharding == set(settings.RESOLVED)
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    flags = {o for action in parser._actions for o in action.option_strings if o.startswith("--")}
    for name in settings.FLAGS:
        assert settings.flag_name(name) in flags, name
    with_variable = [n for n, s in TABLE.items() if s.variable and s.keyword and n != "backend"]
    assert list(settings.FLAGS) == with_variable
    for setting in TABLE.values():
        assert setting.help and "\n" not in setting.help, setting
        assert setting.variable is None or setting.variable.startswith(settings.PREFIX)


def test_every_default_reads_back_and_the_config_defaults_are_the_tables():
    from unified_dist.backends.base import Config

    config = Config()
    for name in settings.RESOLVED:
        assert config.value(name) == TABLE[name].default, name
        assert settings.resolve(name, None, {}) == TABLE[name].default, name


SWITCHES = [n for n, s in TABLE.items() if isinstance(s.kind, settings.Switch) and s.variable and s.read_by != "tools"]


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("text,value", [("1", True), ("TRUE", True), (" yes ", True), ("On", True),
                                        ("0", False), ("false", False), ("No", False), (" off", False)])
def test_every_switch_reads_the_same_words(name, text, value):
    assert TABLE[name].from_environment({TABLE[name].variable: text}) is value


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("text", ["maybe", "2", "enabled", "y"])
def test_an_unclear_switch_is_a_one_line_error_naming_the_accepted_words(name, text):
    variable = TABLE[name].variable
    with pytest.raises(SettingError) as info:
        TABLE[name].from_environment({variable: text})
    assert str(info.value) == (f"{variable}={text!r} is neither on nor off; "
                               "use 1, true, yes, on or 0, false, no, off (any case)")


@pytest.mark.parametrize("variable", ["UNIFIED_DIST_SYNC_BATCHNORM", "UNIFIED_DIST_DEBUG", "UNIFIED_DIST_BUCKET_VIEW",
                                      "UNIFIED_DIST_CHECK_FINITE", "UNIFIED_DIST_TIMEOUT", "UNIFIED_DIST_SHARDING",
                                      "UNIFIED_DIST_GRADIENT_ACCUMULATION_STEPS", "UNIFIED_DIST_BUCKET_MB"])
def test_init_refuses_an_unclear_variable(monkeypatch, variable):
    ud.shutdown()
    monkeypatch.setenv(variable, "maybe")
    with pytest.raises(ud.UnifiedDistError) as info:
        ud.init(backend="single")
    assert str(info.value).startswith(f"{variable}='maybe'") and "\n" not in str(info.value)


def test_the_slurm_switch_is_strict_in_detection_too():
    from unified_dist.detection import detect

    with pytest.raises(SettingError, match="UNIFIED_DIST_SLURM='nope' is neither on nor off"):
        detect({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "UNIFIED_DIST_SLURM": "nope"})


@pytest.mark.parametrize("name,value,words", [
    ("debug", "maybe", "init(debug='maybe') takes True or False"),
    ("timeout", "soon", "timeout must be a positive number of seconds, got 'soon'"),
    ("timeout", 0, "timeout must be a positive number of seconds, got 0"),
    ("gradient_accumulation_steps", 2.5, "gradient_accumulation_steps must be an integer >= 1, got 2.5"),
    ("sharding", "zero3", "unknown sharding 'zero3'; use one of no, fsdp"),
    ("bucket_mb", -1, "bucket size must be a positive number of MiB, got -1"),
])
def test_a_bad_keyword_is_a_one_line_error(name, value, words):
    with pytest.raises(ud.UnifiedDistError) as info:
        settings.resolve(name, value, {})
    assert words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("name,launcher,code", [
    ("mixed_precision", {"ACCELERATE_MIXED_PRECISION": "bf16"}, "no"),
    ("gradient_accumulation_steps", {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, 2),
    ("debug", {"ACCELERATE_DEBUG_MODE": "true"}, False),
    ("sharding", {"ACCELERATE_USE_FSDP": "true"}, "no"),
])
def test_the_code_contradicting_the_launcher_is_refused_and_agreeing_is_fine(name, launcher, code):
    with pytest.raises(ud.LaunchError, match=f"init\\({name}=.*contradicts"):
        settings.resolve(name, code, launcher)
    said = settings.resolve(name, None, launcher)
    assert said != TABLE[name].default and settings.resolve(name, said, launcher) == said


def test_a_launchers_own_default_says_nothing():
    assert settings.resolve("mixed_precision", "bf16", {"ACCELERATE_MIXED_PRECISION": "no"}) == "bf16"
    assert settings.resolve("gradient_accumulation_steps", 4, {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1"}) == 4


def test_a_second_init_with_another_value_is_refused(monkeypatch):
    ud.shutdown()
    ud.init(backend="single", timeout=30)
    try:
        ud.init(timeout=30.0, debug=False)  # the same values: nothing happens
        with pytest.raises(ud.UnifiedDistError, match="already called with timeout=30.0"):
            ud.init(timeout=31)
        with pytest.raises(ud.UnifiedDistError, match="already called with sync_batchnorm=False"):
            ud.init(sync_batchnorm=True)
    finally:
        ud.shutdown()


def test_launch_hands_every_flag_to_the_script_by_its_variable():
    from unified_dist.cli import launch

    values = {"timeout": 30.0, "debug": True, "check_finite": False, "gradient_accumulation_steps": 4,
              "bucket_view": False, "mixed_precision": "bf16"}
    command = launch.build(launch.Plan(backend="torch", script="t.py", settings=values), environ={})
    assert {k: v for k, v in command.env.items() if k.startswith("UNIFIED_DIST_")} == {
        "UNIFIED_DIST_MIXED_PRECISION": "bf16", "UNIFIED_DIST_GRADIENT_ACCUMULATION_STEPS": "4",
        "UNIFIED_DIST_TIMEOUT": "30", "UNIFIED_DIST_DEBUG": "1", "UNIFIED_DIST_BUCKET_VIEW": "0",
        "UNIFIED_DIST_CHECK_FINITE": "0"}
    # what the script's init then reads back is what was asked
    from unified_dist.session import config_from

    config = config_from({}, command.env, cuda=False)
    assert (config.timeout.total_seconds(), config.debug, config.check_finite, config.gradient_accumulation_steps,
            config.bucket_view, config.mixed_precision) == (30.0, True, False, 4, False, "bf16")
    accelerate = launch.build(launch.Plan(backend="accelerate", script="t.py", settings=values), environ={})
    assert "UNIFIED_DIST_MIXED_PRECISION" not in accelerate.env and "--mixed_precision" in accelerate.argv
    assert accelerate.argv[accelerate.argv.index("--mixed_precision") + 1] == "bf16"


def test_the_docs_table_is_the_settings_table():
    """docs/settings.md's table states every row of TABLE as it is (keyword, variable, flag, launcher,
    accepts, default)."""
    text = (ROOT / "docs" / "settings.md").read_text()
    documented = [line for line in text.splitlines() if line.startswith("| `") or line.startswith("| —")]
    expected = []
    for name, s in TABLE.items():
        cells = [f"`{name}`" if s.keyword else "—", f"`{s.variable}`" if s.variable else "—",
                 f"`{settings.flag_name(name)}`" if name in settings.FLAGS else "—",
                 f"`{s.launcher.spelled}`" if s.launcher else "—", s.accepted().replace(" | ", ", "), s.shown_default()]
        expected.append("| " + " | ".join(cells) + " |")
    assert documented == expected


def test_init_itself_warns_once_about_a_misspelled_variable(monkeypatch):
    """docs/settings.md: ``ud.init`` (not only ``unified-dist env``) warns once with the closest name."""
    monkeypatch.setattr(settings, "_warned", set())
    monkeypatch.setenv("UNIFIED_DIST_SYNCBATCHNORM", "1")
    ud.shutdown()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            ud.init(backend="single")
            ud.shutdown()
    messages = [str(c.message) for c in caught if "UNIFIED_DIST_SYNCBATCHNORM" in str(c.message)]
    assert len(messages) == 1 and "did you mean UNIFIED_DIST_SYNC_BATCHNORM?" in messages[0], messages


@pytest.mark.parametrize("name,launcher,variable,expected", [
    ("mixed_precision", {"ACCELERATE_MIXED_PRECISION": "bf16"}, {"UNIFIED_DIST_MIXED_PRECISION": "no"}, "bf16"),
    ("gradient_accumulation_steps", {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"},
     {"UNIFIED_DIST_GRADIENT_ACCUMULATION_STEPS": "2"}, 4),
])
def test_what_the_launcher_said_beats_the_variable(name, launcher, variable, expected):
    """docs/settings.md: the code > what the launcher said > the variable > the default."""
    assert settings.resolve(name, None, {**launcher, **variable}) == expected
