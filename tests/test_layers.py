"""Layers point one way: the API layer (the public functions) over the session, the session over
everything else. Nothing below the facade imports it, at module level or inside a function
(a function-level import hides a cycle until it runs: sync_batchnorm once reached the facade
from inside three functions while backends/base.py imported sync_batchnorm)."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "unified_dist"
API = {"unified_dist.facade", "unified_dist.saving", "unified_dist.elastic", "unified_dist.spawn"}
"""The public functions: they reach the session and delegate."""
SESSION = {"unified_dist.session"}
OUTSIDE = ("unified_dist.cli", "unified_dist.testing", "unified_dist.__main__", "unified_dist.horovod")
"""Tools built on the public API (the command line, test helpers, horovod.torch's API): above every layer."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, name: str) -> set:
    """Every unified_dist module that ``path`` (module ``name``) imports anywhere in its code
    (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            found.add(stem)
            found.update(f"{stem}.{alias.name}" for alias in node.names)  # `from . import facade`
    return {m for m in found if m.startswith("unified_dist")}


def layer(name: str) -> int:
    """0: below the session; 1: the session; 2: the public API; 3: tools built on it."""
    if name.startswith(OUTSIDE):
        return 3
    if name in API:
        return 2
    if name in SESSION:
        return 1
    return 0


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if module_name(p) != "unified_dist"}


@pytest.mark.parametrize("name", [n for n in MODULES if layer(n) < 3])
def test_no_module_imports_a_layer_above_its_own(name):
    upward = sorted(m for m in imports(MODULES[name], name) if m in MODULES and layer(m) > layer(name))
    assert upward == [], f"{name} (layer {layer(name)}) imports {upward}, a layer above it"


def test_the_layers_are_what_the_docs_say():
    assert set(MODULES) >= API | SESSION
    assert layer("unified_dist.sync_batchnorm") == layer("unified_dist.backends.base") == 0


def test_the_scan_finds_a_function_level_import_of_the_facade(tmp_path):
    """The check itself can fail: a module below that imports the facade inside a function."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from .. import facade\n    from ..session import current\n")
    name = "unified_dist.backends.probe"
    found = imports(probe, name)
    assert {"unified_dist.facade", "unified_dist.session"} <= found
    assert sorted(m for m in found if m in MODULES and layer(m) > layer(name)) == ["unified_dist.facade",
                                                                                    "unified_dist.session"]
