"""Layers point one way, and the folders show them. From the bottom up:

- the ground floor: the top-level modules every layer uses (errors, settings, registry, nested,
  compat: the switches between torch releases);
- the subpackages, each on its own floor in :data:`FLOORS` order (detection, data, checkpoint,
  parallel, backends, collectives, training): a folder imports only the ground floor and the folders
  below it;
- the session (``session.py``), over all of them;
- the experiment trackers (``trackers/``), which ask the session which rank writes;
- the public API (``facade.py``, ``saving.py``, ``elastic.py``, ``spawn.py``): the functions users call,
  which reach the session and delegate;
- the peers' APIs over it (``accelerate/``: Accelerate's ``Accelerator`` on every launcher;
  ``horovod/``: ``horovod.torch``'s API on every launcher);
- the tools built on the public API (``cli/``, ``checks/``, ``testing/``, ``__main__``): ``checks/``
  (what the commands run) never imports ``cli/`` (the commands).

Nothing imports a floor above its own, at module level or inside a function (a function-level
import hides a cycle until it runs: sync_batchnorm once reached the facade from inside three
functions while backends/base.py imported sync_batchnorm)."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "unified_dist"
FLOORS = ("ground", "detection", "data", "checkpoint", "parallel", "backends", "collectives", "training",
          "session", "trackers", "api", "accelerate", "horovod", "tools")
"""Bottom to top. A subpackage's floor is its folder's name here; cli/, checks/ and testing/ are tools."""
TOOLS = ("cli", "checks", "testing")
API = {"facade", "saving", "elastic", "spawn"}
"""The top-level modules of the public API."""
MAX_TOP_LEVEL = 12
"""Top-level modules besides the subpackages (``__init__`` and ``__main__`` included)."""


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


def floor(name: str) -> int:
    """The floor of module ``name`` (an index into :data:`FLOORS`)."""
    parts = name.split(".")
    if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir():  # in a subpackage (or the subpackage itself)
        folder = parts[1]
        if folder in TOOLS:
            return FLOORS.index("tools")
        if folder not in FLOORS:
            raise AssertionError(f"unified_dist/{folder}/ has no floor: add it to FLOORS in tests/unit/test_layers.py")
        return FLOORS.index(folder)
    if parts[-1] == "__main__":
        return FLOORS.index("tools")
    if parts[-1] == "session":
        return FLOORS.index("session")
    return FLOORS.index("api" if parts[-1] in API else "ground")


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if module_name(p) != "unified_dist"}


@pytest.mark.parametrize("name", [n for n in MODULES if floor(n) < FLOORS.index("tools")])
def test_no_module_imports_a_floor_above_its_own(name):
    upward = sorted(f"{m} ({FLOORS[floor(m)]})" for m in imports(MODULES[name], name)
                    if m in MODULES and floor(m) > floor(name))
    assert upward == [], f"{name} (floor {FLOORS[floor(name)]}) imports {upward}, a floor above it"


def test_every_folder_has_a_floor_and_the_top_level_stays_small():
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert [f for f in folders if f not in FLOORS and f not in TOOLS] == []
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


def test_the_floors_are_what_the_docs_say():
    assert {f"unified_dist.{m}" for m in API} | {"unified_dist.session"} <= set(MODULES)
    assert floor("unified_dist.parallel.sync_batchnorm") < floor("unified_dist.backends.base") < \
        floor("unified_dist.session") < floor("unified_dist.facade") < floor("unified_dist.cli.main")
    assert floor("unified_dist.errors") == floor("unified_dist.nested") == 0


def test_the_scan_finds_a_function_level_import_of_the_facade(tmp_path):
    """The check itself can fail: a module below that imports the facade inside a function."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from .. import facade\n    from ..session import current\n")
    name = "unified_dist.backends.probe"
    found = imports(probe, name)
    assert {"unified_dist.facade", "unified_dist.session"} <= found
    assert sorted(m for m in found if m in MODULES and floor(m) > floor(name)) == ["unified_dist.facade",
                                                                                    "unified_dist.session"]


def test_a_folder_importing_a_folder_above_it_is_caught(tmp_path):
    """The folder rule can fail too: parallel/ (below backends/) reaching into backends/."""
    probe = tmp_path / "probe.py"
    probe.write_text("from ..backends.process_group import host_names\n")
    name = "unified_dist.parallel.probe"
    assert [m for m in imports(probe, name) if m in MODULES and floor(m) > floor(name)] == \
        ["unified_dist.backends.process_group"]


def circles(graph: dict) -> list:
    """The import circles of ``graph`` (module -> the modules it imports): its strongly connected parts of
    more than one module, each sorted (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    part.append(member)
                    if member == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def import_graph() -> dict:
    """Each module of the package -> the package's modules it imports anywhere in its code, leaving out its own
    parent packages (Python imports a module's parents before the module, so such an edge closes no circle)."""
    return {name: {m for m in imports(path, name) if m in MODULES and m != name and not name.startswith(m + ".")}
            for name, path in MODULES.items()}


def test_no_import_circle():
    """Two modules that import each other (at module level or inside a function) are one module split badly:
    what both need belongs in a leaf module they both import (cli/commands.py, horovod/_names.py)."""
    assert circles(import_graph()) == []


def test_the_checks_import_no_command():
    """checks/ sits below cli/: the commands start the checks, the checks never reach back into a command
    (a worker that imported cli/ would load the command line in every rank)."""
    upward = sorted(f"{name} -> {m}" for name, path in MODULES.items() if name.startswith("unified_dist.checks")
                    for m in imports(path, name) if m.startswith("unified_dist.cli"))
    assert upward == []


def test_the_circle_check_finds_a_circle_through_a_function_level_import():
    """The check itself can fail: launch -> replicas at module level, replicas -> launch inside a function."""
    graph = {"a.launch": {"a.replicas"}, "a.replicas": {"a.launch"}, "a.leaf": set(), "a.x": {"a.y"},
             "a.y": {"a.z"}, "a.z": {"a.x", "a.leaf"}}
    assert sorted(circles(graph)) == [["a.launch", "a.replicas"], ["a.x", "a.y", "a.z"]]
