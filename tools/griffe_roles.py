"""Griffe extension for the API reference (mkdocs.yml: mkdocstrings' ``extensions``): the docstrings
use Sphinx roles (``:func:`init```, ``:class:`~unified_dist.errors.LaunchError```), which Markdown
would show as literal text. Each role becomes a cross-reference when its target is a public name
(one of ``unified_dist.__all__``, whose pages are docs/api/), else plain code. The source is not
changed: ``help(ud.init)`` still reads as written.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Dict

import griffe

ROLE = re.compile(r":(?:func|class|data|mod|meth|attr|exc|obj):`(?P<body>[^`]+)`")
TITLED = re.compile(r"(?P<title>.+?)\s*<(?P<target>[^<>]+)>$")


def _public() -> Dict[str, str]:
    """Public name -> its module (``"facade"``), read from the package this site documents."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    import unified_dist

    return {name: module.lstrip(".") for name, module in unified_dist._FROM.items()}


def _anchor(target: str, public: Dict[str, str]) -> str | None:
    """The API page anchor of ``target`` (``unified_dist.init``), or None when it has no entry there."""
    for prefix in ("unified_dist.", "ud."):
        if target.startswith(prefix):
            target = target[len(prefix):]
    if target in public:
        return f"unified_dist.{target}"
    module, _, name = target.rpartition(".")
    if public.get(name) == module:
        return f"unified_dist.{name}"
    return None


def render_roles(text: str, public: Dict[str, str]) -> str:
    """``text`` with every Sphinx role replaced by a Markdown cross-reference or code span."""

    def replace(match: "re.Match[str]") -> str:
        body = match.group("body").strip()
        titled = TITLED.match(body)
        if titled:
            title, target = titled.group("title"), titled.group("target")
        else:
            target = body.lstrip("~")
            title = target.rpartition(".")[2] if body.startswith("~") else target
        anchor = _anchor(target, public)
        return f"[`{title}`][{anchor}]" if anchor else f"`{title}`"

    return ROLE.sub(replace, text)


class SphinxRoles(griffe.Extension):
    def __init__(self) -> None:
        super().__init__()
        self._public = _public()

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = render_roles(obj.docstring.value, self._public)
