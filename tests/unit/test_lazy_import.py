"""``import unified_dist`` and the ``unified-dist`` command start without importing torch (seconds on
a small machine); every public name still resolves, to the object its module defines."""
import importlib
import subprocess
import sys

import pytest

import unified_dist as ud
from unified_dist.testing.launchers import ROOT, child_env

pytestmark = pytest.mark.fresh_python  # what a process imports at its start: a fork of the zygote has torch already


def test_neither_the_package_nor_the_command_imports_torch_until_asked():
    code = ("import sys, unified_dist, unified_dist.cli.main\n"
            "assert 'torch' not in sys.modules, 'torch imported at startup'\n"
            "unified_dist.world_size\n"
            "assert 'torch' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_every_public_name_resolves_to_its_module_object():
    assert set(ud.__all__) == set(ud._FROM)
    for name in ud.__all__:
        module = importlib.import_module(ud._FROM[name], "unified_dist")
        assert getattr(ud, name) is getattr(module, name), name
    assert set(ud.__all__) <= set(dir(ud))
    try:
        ud.no_such_name  # noqa: B018 - the lookup must raise
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
