"""unified_dist.settings: every UNIFIED_DIST_* variable is declared once, and a name outside that
table (a misspelling) is reported with the closest declared one."""
import inspect
import re
import warnings
from pathlib import Path

import pytest

from launchers import ROOT
from unified_dist import settings
from unified_dist.settings import SETTINGS, in_effect, unknown_variables, warn_unknown

SCANNED = ("unified_dist", "examples", "tools", "bench", "Makefile")
"""Where the variables are read: the library, its examples, tools and benchmarks, the Makefile."""
LITERAL = re.compile(r"UNIFIED_DIST_[A-Z_]+")


def literals(root: Path):
    """Every ``UNIFIED_DIST_*`` name spelled anywhere under ``root``'s scanned paths."""
    found = set()
    for top in SCANNED:
        path = root / top
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
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
    assert literals(tmp_path) - set(SETTINGS) == {"UNIFIED_DIST_BRAND_NEW", "UNIFIED_DIST_OTHER"}


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
    rows = {row["variable"]: row for row in in_effect({"UNIFIED_DIST_MIXED_PRECISION": "bf16"})}
    assert list(rows) == list(SETTINGS)
    assert rows["UNIFIED_DIST_MIXED_PRECISION"] == {
        "variable": "UNIFIED_DIST_MIXED_PRECISION", "value": "bf16", "source": "environment",
        "keyword": "mixed_precision", "accepted": "no | bf16 | fp16", "help": SETTINGS["UNIFIED_DIST_MIXED_PRECISION"].help}
    assert (rows["UNIFIED_DIST_TIMEOUT"]["value"], rows["UNIFIED_DIST_TIMEOUT"]["source"]) == ("600", "default")


def test_the_table_agrees_with_the_modules_that_parse_the_values():
    """The table states choices and defaults that their readers still own; they must not drift apart."""
    from unified_dist import compression, facade, flags, precision, registry
    from unified_dist.backends.base import DEFAULT_TIMEOUT_S

    assert SETTINGS[settings.BACKEND_ENV].values == registry.NAMES
    assert SETTINGS[precision.ENV_VAR].values == precision.MODES
    assert SETTINGS[flags.SHARDING_ENV].values == flags.SHARDING_MODES
    assert SETTINGS[compression.ENV_VAR].values == (*compression.MODES, "none")
    assert float(SETTINGS[settings.TIMEOUT_ENV].default) == DEFAULT_TIMEOUT_S
    init_keywords = set(inspect.signature(facade.init).parameters)
    for setting in SETTINGS.values():
        assert setting.keyword is None or setting.keyword in init_keywords, setting
        assert setting.variable.startswith(settings.PREFIX) and setting.help and "\n" not in setting.help
