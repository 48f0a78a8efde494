"""The documentation site (mkdocs.yml, docs/), built once per module as ``make docs`` builds it:
``python -m mkdocs build --strict`` in a subprocess (one process: no launch), into a temporary folder.

What must hold: the strict build exits 0 with no WARNING line; every name in ``unified_dist.__all__``
(read at test time, so a new public name needs its entry) has an entry in the API reference under
docs/api/: a heading whose id is mkdocstrings' anchor ``unified_dist.<name>``, followed by that
name's docstring rendered (its first words as the source writes them, read with griffe from the
source file, not through the site); no Sphinx role (``:func:`...```) is left as literal text; every
page in mkdocs.yml's nav was built; the home page links the API reference.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Set, Tuple

import pytest
import yaml

from unified_dist.testing.launchers import ROOT

TIMEOUT = 120  # the build takes about 2 s on 2 cores


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
    return SimpleNamespace(dir=out, returncode=proc.returncode, log=proc.stdout + proc.stderr)


def _built(site) -> Path:
    """The site folder. A strict build that warned still wrote every page (mkdocs aborts after writing),
    so the checks below read it and name what they find; the exit status is the first test's."""
    if not (site.dir / "index.html").is_file():
        pytest.fail(f"mkdocs build wrote no index.html (exit {site.returncode}):\n{site.log[-3000:]}", pytrace=False)
    return site.dir


class _Entries(HTMLParser):
    """Heading id -> the text of the docstring rendered after it: the paragraphs of the first
    ``doc-contents`` block that follows the heading, without the class's "Bases:" line and without
    members (nested ``doc-children``/``doc-object`` blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.docs: Dict[str, str] = {}
        self.links: Dict[str, Set[str]] = {}  # heading id -> the anchors its docstring links to
        self._pending: Optional[str] = None  # a heading seen, its contents not yet
        self._current: Optional[str] = None
        self._depth = 0  # open divs inside the contents being read
        self._skip = 0  # > 0 inside members (nested divs)
        self._in_bases = False  # inside the "Bases: ..." paragraph
        self._text: List[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if tag in ("h1", "h2", "h3", "h4", "h5", "h6") and "doc-heading" in classes and attrs.get("id"):
            if self._current is None:
                self._pending = attrs["id"]
            return
        if self._current is None:
            if tag == "div" and "doc-contents" in classes and self._pending is not None:
                self._current, self._pending, self._depth, self._skip, self._text = self._pending, None, 1, 0, []
                self._in_bases = False
            return
        if tag == "div":
            self._depth += 1
            if self._skip or "doc-children" in classes or "doc-object" in classes:
                self._skip += 1
        elif tag == "p" and "doc-class-bases" in classes:
            self._in_bases = True
        elif tag == "a" and not self._skip and not self._in_bases and "#" in (attrs.get("href") or ""):
            self.links.setdefault(self._current, set()).add(attrs["href"].partition("#")[2])

    def handle_endtag(self, tag):
        if self._current is None:
            return
        if tag == "div":
            self._depth -= 1
            if self._skip:
                self._skip -= 1
            if self._depth == 0:
                self.docs[self._current] = " ".join("".join(self._text).split())
                self._current = None
        elif tag == "p":
            self._in_bases = False

    def handle_data(self, data):
        if self._current is not None and not self._skip and not self._in_bases:
            self._text.append(data)


def _api_entries(site_dir: Path) -> Tuple[Dict[str, str], Dict[str, Set[str]]]:
    """Over every page of docs/api/: heading id -> rendered docstring text, and -> anchors it links to."""
    docs: Dict[str, str] = {}
    links: Dict[str, Set[str]] = {}
    for page in sorted((site_dir / "api").glob("*.html")):
        parser = _Entries()
        parser.feed(page.read_text(encoding="utf-8"))
        docs.update(parser.docs)
        links.update(parser.links)
    return docs, links


ROLE_TARGET = re.compile(r":[a-z]+:`(?:[^`<]*<)?~?([\w.]+)>?`")


def _first_words(docstring: str, count: int = 4) -> str:
    """The docstring's first ``count`` words as a reader sees them: no backticks, no Sphinx roles."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", docstring)
    return " ".join(text.replace("`", "").split()[:count])


def test_strict_build_passes_without_warnings(site):
    warnings = [line for line in site.log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert site.returncode == 0 and not warnings, (f"mkdocs build --strict: exit {site.returncode}\n"
                                                   + ("\n".join(warnings) or site.log[-3000:]))


def test_every_public_name_has_an_entry_with_its_docstring(site):
    import griffe

    import unified_dist

    entries, links = _api_entries(_built(site))
    names = list(unified_dist.__all__)
    assert len(names) >= 60, names  # issue #30 counted 60 public names; fewer means __all__ was not read
    missing = [name for name in names if f"unified_dist.{name}" not in entries]
    assert not missing, f"no entry (heading id unified_dist.<name>) in docs/api/ for: {missing}"
    empty = [name for name in names if not entries[f"unified_dist.{name}"]]
    assert not empty, f"entries with no rendered docstring: {empty}"
    package = griffe.load("unified_dist", search_paths=[str(ROOT)], resolve_aliases=True)
    wrong, unlinked = {}, {}
    for name in names:
        source = package[name].docstring
        assert source is not None and source.value.strip(), f"unified_dist.{name} has no docstring in the source"
        words = _first_words(source.value)
        if words not in entries[f"unified_dist.{name}"]:
            wrong[name] = (words, entries[f"unified_dist.{name}"][:120])
        # a Sphinx role naming a public name (:func:`init`, :class:`~unified_dist.errors.LaunchError`) is a link
        referenced = {target.rpartition(".")[2] for target in ROLE_TARGET.findall(source.value)} & set(names)
        missing_links = {f"unified_dist.{ref}" for ref in referenced} - links.get(f"unified_dist.{name}", set())
        if missing_links:
            unlinked[name] = sorted(missing_links)
    assert not wrong, f"entries whose rendered docstring does not start as the source's: {wrong}"
    assert not unlinked, f"entries whose docstring names a public name without linking its entry: {unlinked}"


def test_no_sphinx_role_is_left_as_text(site):
    role = re.compile(r":(?:func|class|data|mod|meth|attr|exc|obj):(?:<code>|`)")
    found = {page.name: role.findall(page.read_text(encoding="utf-8"))
             for page in sorted((_built(site) / "api").glob("*.html"))}
    assert not {page: hits for page, hits in found.items() if hits}, found


def _nav_pages(nav) -> List[str]:
    if isinstance(nav, str):
        return [nav] if nav.endswith(".md") else []
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    return []


class _AnyTagLoader(yaml.SafeLoader):
    """mkdocs.yml may hold ``!!python/name:`` and ``!ENV`` tags; the nav has none, so they read as None."""


_AnyTagLoader.add_multi_constructor("", lambda loader, suffix, node: None)


def test_every_nav_page_was_built(site):
    site_dir = _built(site)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_AnyTagLoader)
    pages = _nav_pages(config["nav"])
    assert "api/index.md" in pages, pages
    absent = [page for page in pages if not (site_dir / (page[: -len(".md")] + ".html")).is_file()]
    assert not absent, f"nav pages missing from the built site: {absent}"


def test_home_page_links_the_api_reference(site):
    home = (_built(site) / "index.html").read_text(encoding="utf-8")
    assert re.search(r'<a [^>]*href="api/index\.html"', home), "index.html has no link to api/index.html"
