"""The benchmark pages of the documentation site (docs/benchmarks/*.md) are filled from the benchmarks'
results folders (bench/<topic>/results/) at build time by the MkDocs hook tools/docs_hook.py; the README's
five-line summary is bench/shared/summary.py's output.

Fast: no launches, no site build (tests/docs/test_docs_site.py-style builds are `make docs`'s job). The
expected values are read from the results files here with json and formatted here, not through the
hook's lookup code; a copy of the results with one value changed must change what a page shows, and
a missing file or key must stop the rendering with one line that names it.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "docs" / "benchmarks"

sys.path.insert(0, str(ROOT / "bench" / "shared"))
_spec = importlib.util.spec_from_file_location("docs_hook", ROOT / "tools" / "docs_hook.py")
hook = importlib.util.module_from_spec(_spec)
sys.modules["docs_hook"] = hook  # bench/shared/summary.py imports it by this name: one module, one ResultsError
_spec.loader.exec_module(hook)
import summary  # noqa: E402  (bench/shared/summary.py)


def _json(name: str, root: Path = ROOT) -> dict:
    """The results file ``name``, a path from ``root`` (the repository, or a copy of its results)."""
    return json.loads((root / name).read_text())


def _table_rows(markdown: str) -> list:
    """The cells of every table row of ``markdown`` that is neither a header nor a separator."""
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    body = [r for i, r in enumerate(rows) if not set(r) <= set("|-: ") and not (i + 1 < len(rows) and
                                                                               set(rows[i + 1]) <= set("|-: "))]
    return [[c.strip() for c in r.strip("|").split("|")] for r in body]


def _copy(tmp_path: Path) -> Path:
    """A root holding a copy of every benchmark's results JSON at its path (what the hook reads)."""
    out = tmp_path / "root"
    for path in ROOT.glob("bench/*/results/*.json"):
        target = out / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    return out


def test_overhead_table_cells_are_the_json_values():
    data = _json("bench/step/results/overhead.json")
    rows = _table_rows(hook.render("<!-- results: bench/step/results/overhead.json overhead-table -->"))
    assert [r[0] for r in rows] == list(data["results"])
    for cells, (backend, r) in zip(rows, data["results"].items()):
        assert cells[1] == f"{r['facade_step_s']:.3f}", backend
        assert cells[2] == f"{r['native_step_s']:.3f}", backend
        assert cells[3] == f"**{r['ratio']:.3f}** [{r['ratio_iqr'][0]:.3f}-{r['ratio_iqr'][1]:.3f}]", backend
        assert cells[4] == f"{r['separate_launch_ratio']:.3f}", backend
        assert cells[5] == f"{r['facade_peak_rss_mib']:.0f}" and cells[6] == f"{r['native_peak_rss_mib']:.0f}"


def test_memory_and_network_tables_are_the_json_values():
    mem = _json("bench/memory_layouts/results/memory_layouts.json")
    rows = _table_rows(hook.render("<!-- results: bench/memory_layouts/results/memory_layouts.json memory-table -->"))
    assert len(rows) == len(mem["rows"]) == 14
    for cells, r in zip(rows, mem["rows"]):
        assert cells[:3] == [r["model"], str(r["processes"]), r["label"]]
        assert cells[6] == f"**{r['bytes']['total'] / 1048576:.1f}**"
    net = _json("bench/network/results/network.json")
    rows = _table_rows(hook.render("<!-- results: bench/network/results/network.json network-table -->"))
    assert len(rows) == len(net["rows"]) == 18
    for cells, r in zip(rows, net["rows"]):
        assert (cells[0], cells[2], cells[8], cells[9]) == (
            r["rate"], r["backend"], f"{r['samples_per_s']:.2f}", f"**{r['efficiency']:.2f}**")


def test_inline_values_and_selectors_are_the_json_values():
    network, accuracy = "bench/network/results/network.json", "bench/time_to_accuracy/results/accuracy.json"
    net = _json(network)
    pick = {(r["rate"], r["backend"], r["compression"]): r for r in net["rows"]}
    gain = pick["200mbit", "torch", "bf16"]["samples_per_s"] / pick["200mbit", "torch", None]["samples_per_s"]
    acc = _json(accuracy)["summary"]["ablation: example, fp32, without --group-by-length"]
    text = hook.render(
        f"a {{{{ results:{network}:rows[rate=1gbit,backend=horovod,compression=none].efficiency:.4f }}}} "
        f"b {{{{ results:{network}:rows[rate=200mbit,backend=torch,compression=bf16].samples_per_s / "
        "rows[rate=200mbit,backend=torch,compression=none].samples_per_s:.4f }} "
        f'c {{{{ results:{accuracy}:summary["ablation: example, fp32, without --group-by-length"]'
        ".time_to_threshold_s.mean:.3f }} d {{ results:bench/step/results/overhead.json:commit: }} "
        f"e {{{{ results:{accuracy}:seeds:len }}}}")
    commit = _json("bench/step/results/overhead.json")["commit"]
    assert text == (f"a {pick['1gbit', 'horovod', None]['efficiency']:.4f} b {gain:.4f} "
                    f"c {acc['time_to_threshold_s']['mean']:.3f} d {commit} e 3")


def test_a_changed_results_file_changes_the_page_and_the_plot(tmp_path):
    copy = _copy(tmp_path)
    page = (PAGES / "overhead.md").read_text()
    before = hook.render(page, copy)
    data = _json("bench/step/results/overhead.json", copy)
    data["results"]["torch"]["ratio"] = 1.23456
    data["commit"] = "feedbee"
    (copy / "bench/step/results/overhead.json").write_text(json.dumps(data))
    after = hook.render(page, copy)
    assert "**1.235**" in after and "1.235 and" in after and "commit `feedbee`" in after
    assert "1.235" not in before and "feedbee" not in before
    plot = hook.plot_bytes("scaling.png", copy)
    scaling = _json("bench/step/results/scaling.json", copy)
    scaling["results"]["torch"]["samples_per_s_2"] *= 0.5
    (copy / "bench/step/results/scaling.json").write_text(json.dumps(scaling))
    changed = hook.plot_bytes("scaling.png", copy)
    assert plot.startswith(b"\x89PNG") and changed.startswith(b"\x89PNG") and changed != plot


def test_a_missing_key_or_file_stops_with_one_line_naming_it(tmp_path):
    copy = _copy(tmp_path)
    data = _json("bench/step/results/scaling.json", copy)
    del data["results"]["horovod"]["efficiency"]
    (copy / "bench/step/results/scaling.json").write_text(json.dumps(data))
    with pytest.raises(hook.ResultsError) as page:
        hook.render((PAGES / "scaling.md").read_text(), copy)
    with pytest.raises(hook.ResultsError) as inline:  # no format: a lookup that gave "" would render blank
        hook.render("efficiency {{ results:bench/step/results/scaling.json:results.horovod.efficiency: }}", copy)
    with pytest.raises(hook.ResultsError) as table:
        hook.render("<!-- results: bench/step/results/scaling.json scaling-table -->", copy)
    (copy / "bench/hotpath/results/hotpath.json").unlink()
    with pytest.raises(hook.ResultsError) as missing:
        hook.render("x {{ results:bench/hotpath/results/hotpath.json:commit: }}", copy)
    with pytest.raises(hook.ResultsError) as plot:
        hook.plot_bytes("scaling.png", copy)
    with pytest.raises(hook.ResultsError) as malformed:
        hook.render("{{ results:scaling.json }}", copy)
    with pytest.raises(hook.ResultsError) as ambiguous:  # 6 torch rows: a selector must pick exactly one
        hook.render("{{ results:bench/network/results/network.json:rows[backend=torch].efficiency:.2f }}", copy)
    with pytest.raises(hook.ResultsError) as not_a_value:  # a mapping where a figure was meant
        hook.render("{{ results:bench/step/results/scaling.json:results.horovod:.2f }}", copy)
    for e in (page, inline, table, missing, plot, malformed, ambiguous, not_a_value):
        assert "\n" not in str(e.value), str(e.value)
    assert "bench/step/results/scaling.json" in str(page.value) and "'efficiency'" in str(page.value)
    assert str(inline.value) == ("bench/step/results/scaling.json: no key 'efficiency' in key path "
                                 "'results.horovod.efficiency'")
    assert "bench/step/results/scaling.json" in str(table.value) and "'efficiency'" in str(table.value)
    assert str(missing.value) == "bench/hotpath/results/hotpath.json: no such results file"
    assert "bench/step/results/scaling.json" in str(plot.value) and "'efficiency'" in str(plot.value)
    assert "malformed" in str(malformed.value)
    assert str(not_a_value.value) == ("bench/step/results/scaling.json: key path 'results.horovod' holds dict, "
                                      "not a value")
    assert str(ambiguous.value).startswith("bench/network/results/network.json: 6 elements match [backend=torch]")


def test_every_page_renders_names_its_results_and_has_no_hand_written_table_figure():
    pages = sorted(PAGES.glob("*.md"))
    assert {p.name for p in pages} >= {"index.md", "overhead.md", "collectives.md", "scaling.md", "hot-path.md",
                                       "time-to-accuracy.md", "network.md", "memory.md", "streaming.md"}
    for page in pages:
        source = page.read_text()
        text = hook.render(source)
        assert "results:" not in text.replace("/results:", "").replace("/results/", ""), page.name
        if page.name not in ("index.md", "targets.md"):
            provenance = [line for line in text.splitlines() if re.match(r"\s*- `bench/\w+/results/", line)]
            assert provenance and all("commit `" in line and "`python " in line for line in provenance), page.name
        if page.name != "index.md":  # the index's table lists pages; every other table's figures are generated
            for line in source.splitlines():
                if line.startswith("|") and not set(line) <= set("|-: ") and re.search(r"\d", line):
                    assert "{{ results:" in line, f"{page.name}: hand-written figures in {line[:80]!r}"


def test_the_summary_lines_hold_the_json_values():
    lines = summary.lines()
    assert len(lines) == 5 and all(line.startswith("- **") for line in lines)
    hot, sc = _json("bench/hotpath/results/hotpath.json"), _json("bench/step/results/scaling.json")["results"]
    acc = _json("bench/time_to_accuracy/results/accuracy.json")["summary"]
    acc = acc["example, fp32 (python, 1 process, 2 threads)"]
    mem = {r["layout"]: r["bytes"]["total"] for r in _json("bench/memory_layouts/results/memory_layouts.json")["rows"]
           if (r["model"], r["processes"]) == ("bert", 4)}
    for backend, name in (("torch", "torch"), ("accelerate", "Accelerate"), ("horovod", "Horovod")):
        assert f"{name} {hot['facade_vs_native'][backend]['ratio']:.3f}" in lines[0]
        assert f"{name} {sc[backend]['efficiency']:.2f}" in lines[1]
    assert f"the example {acc['time_to_threshold_s']['mean']:.0f} ± {acc['time_to_threshold_s']['std']:.0f} s" \
        in lines[2] and f"{acc['time_ratio_vs_reference']:.2f} × wall" in lines[2]
    assert f"{hot['eager_vs_compiled']['compiled_over_eager']:.3f} under torchrun" in lines[3]
    assert f"DDP {mem['ddp'] / 2 ** 20:.1f} MiB, FSDP {mem['fsdp'] / 2 ** 20:.1f}," in lines[4]
    ds = {r["layout"]: max(b["total"] for b in r["bytes_per_rank"])
          for r in _json("bench/deepspeed/results/deepspeed.json")["memory"]}
    zero = {stage: f"{ds[stage] / ds['zero0']:.3f}" for stage in ("zero2", "zero3")}
    assert f"AdamW state) {zero['zero3']} × ZeRO-0's, ZeRO-2 {zero['zero2']}" in lines[4]


def test_the_site_config_runs_the_hook_and_lists_every_page():
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^hooks:\n  - tools/docs_hook\.py$", config, re.M)
    for page in PAGES.glob("*.md"):
        assert f"benchmarks/{page.name}" in config, page.name
    assert re.search(r"^  - Changelog: changelog\.md$", config, re.M)


def test_readme_holds_the_five_summary_lines():
    """README.md between <!-- bench-summary:start --> and <!-- bench-summary:end --> is exactly
    `python bench/shared/summary.py`'s output."""
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- bench-summary:start -->\n(.*?)\n?<!-- bench-summary:end -->", readme, re.S)
    assert m, "README.md has no <!-- bench-summary:start --> ... <!-- bench-summary:end --> block"
    assert m.group(1).strip("\n").splitlines() == summary.lines()
