"""MkDocs hook (``hooks:`` in mkdocs.yml): the benchmark pages' tables, figures and plots, read from
the results folders of bench/ (bench/<topic>/results/) at build time, so no table on them holds a
hand-copied figure. It lives in tools/ beside the site's other build extension (griffe_roles.py):
it is part of building the docs, not a benchmark.

Two kinds of marker, on any page:

``<!-- results: FILE[,FILE...] RENDERER [key=value ...] -->``
    on a line of its own (indented to sit in a list item): replaced by a Markdown block (a table, a
    provenance line) that RENDERER makes from the named results files (see ``RENDERERS``; most
    reuse the report functions of the benchmark scripts in ``SCRIPTS``). FILE is a path from the
    repository root, e.g. ``bench/step/results/overhead.json``.

``{{ results:FILE:PATH:FORMAT }}``
    inline: one value of FILE, formatted with Python's ``format(value, FORMAT)`` (e.g. ``.3f``,
    ``.0%``, ``,``; ``len``: the length of a list or mapping). PATH is keys separated by dots; a key
    with dots, spaces or colons is written ``["key"]``; ``[k=v,k2=v2]`` picks the one list element
    whose fields match (``none`` matches a null); a number indexes a list. ``PATH / PATH`` is the
    ratio of two values of the same file.

``<!-- results: - summary -->``: the five summary lines of bench/shared/summary.py (README.md holds them too).
``<!-- results: - gpu-checks -->``: the newest ``make gpu-check`` results file, or the checks not yet run.

The plots (``PLOTS``) are drawn into the site as benchmarks/plots/*.png. A missing results file, key
or renderer fails the build with one line naming it (:class:`ResultsError`), never a blank cell.
"""
from __future__ import annotations

import importlib
import io
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: a marker names its results files by their paths from here
(``bench/hotpath/results/hotpath.json``, ``tools/versions/versions.json``)."""
SCRIPTS = {"report": "bench/shared", "summary": "bench/shared", "network_report": "bench/network",
           "memory_layouts": "bench/memory_layouts", "streaming": "bench/streaming", "suite_time": "bench/suite_time"}
"""The benchmark scripts whose report functions the renderers reuse, and the folder of each."""
GPU_CHECKS = "bench/gpu/results"
"""Where ``make gpu-check`` (unified_dist/checks/gpu.py) writes its dated results files."""

try:
    from mkdocs.exceptions import PluginError as _Base
except ImportError:  # the functions below are also used without MkDocs (tests, bench/shared/summary.py)
    _Base = Exception


def _mod(name: str):
    """The benchmark script ``name`` (one of ``SCRIPTS``) as a module: its folder and bench/shared/ go on
    sys.path, as when it runs (the scripts import their neighbours and the shared helpers by name)."""
    for folder in ("bench/shared", SCRIPTS[name]):
        if str(ROOT / folder) not in sys.path:
            sys.path.insert(0, str(ROOT / folder))
    return importlib.import_module(name)


class ResultsError(_Base):
    """A marker that cannot be filled from its results files: the message is one line naming the file and key."""


BLOCK = re.compile(r"^(?P<indent>[ ]*)<!-- results: (?P<files>\S+) (?P<renderer>[\w-]+)"
                   r"(?P<args>(?: [\w-]+=\S+)*) -->$", re.M)
INLINE = re.compile(r"\{\{ results:(?P<file>[^:\s]+):(?P<path>.+?):(?P<fmt>[^:]*?) \}\}")
SEGMENT = re.compile(r'\["(?P<quoted>[^"]*)"\]|\[(?P<select>[^\]"]*=[^\]"]*)\]|(?P<plain>[^.\[\]]+)')


def load(name: str, root: Path = ROOT) -> dict:
    """The parsed results file ``name`` (e.g. ``bench/step/results/overhead.json``) under ``root``."""
    path = Path(root) / name
    if not path.is_file():
        raise ResultsError(f"{name}: no such results file")
    return json.loads(path.read_text())


def _segments(path: str, where: str) -> list:
    out, pos = [], 0
    path = path.strip()
    while pos < len(path):
        if path[pos] == ".":
            pos += 1
            continue
        m = SEGMENT.match(path, pos)
        if not m:
            raise ResultsError(f"{where}: cannot parse the key path {path!r}")
        out.append(m)
        pos = m.end()
    return out


def _matches(value, wanted: str) -> bool:
    return (value is None and wanted.lower() in ("none", "")) or str(value) == wanted


def lookup(data, path: str, name: str = "?"):
    """The value at ``path`` (the syntax above, without ``/``) in ``data``, the parsed file ``name``."""
    node = data
    where = f"{name}"
    for m in _segments(path, where):
        if m["select"] is not None:
            pairs = [p.split("=", 1) for p in m["select"].split(",")]
            found = [x for x in node if isinstance(x, dict) and all(k in x and _matches(x[k], v) for k, v in pairs)] \
                if isinstance(node, list) else []
            if len(found) != 1:
                raise ResultsError(f"{where}: {len(found)} elements match [{m['select']}] in key path {path!r}, not 1")
            node = found[0]
            continue
        key = m["quoted"] if m["quoted"] is not None else m["plain"].strip()
        if isinstance(node, list) and re.fullmatch(r"-?\d+", key) and -len(node) <= int(key) < len(node):
            node = node[int(key)]
        elif isinstance(node, dict) and key in node:
            node = node[key]
        else:
            raise ResultsError(f"{where}: no key {key!r} in key path {path!r}")
    return node


def value(name: str, path: str, root: Path = ROOT):
    """``lookup`` in the file ``name``, or the ratio of two such values for ``A / B``."""
    data = load(name, root)
    parts = re.split(r" / (?=(?:[^\"]*\"[^\"]*\")*[^\"]*$)", path)  # ' / ' outside quotes
    values = [lookup(data, p, name) for p in parts]
    if len(values) == 1:
        return values[0]
    if len(values) != 2 or not all(isinstance(v, (int, float)) for v in values):
        raise ResultsError(f"{name}: {path!r} is not a ratio of two numbers")
    return values[0] / values[1]


def inline(name: str, path: str, fmt: str, root: Path = ROOT) -> str:
    v = value(name, path, root)
    if fmt == "len" and isinstance(v, (dict, list)):
        return str(len(v))
    if v is None or isinstance(v, (dict, list)):
        raise ResultsError(f"{name}: key path {path!r} holds {type(v).__name__}, not a value")
    try:
        return format(v, fmt)
    except (TypeError, ValueError) as e:
        raise ResultsError(f"{name}: cannot format {path!r} = {v!r} with {fmt!r} ({e})") from None


# --- renderers: (list of parsed files, their names, keyword arguments) -> Markdown lines ----------


def _need(data: dict, key: str, name: str):
    if key not in data:
        raise ResultsError(f"{name}: no key {key!r}")
    return data[key]


def provenance(datas, names, **_):
    """Where each file came from: commit, command, CPU and date where recorded, load and steal."""
    lines = []
    for d, name in zip(datas, names):
        parts = [f"commit `{_need(d, 'commit', name)}`", f"`{_need(d, 'command', name)}`"]
        if d.get("cpu"):
            parts.append(f"CPU: {d['cpu']}")
        elif d.get("machine", {}).get("date"):
            parts.append(f"{d['machine']['date']} (CPU not recorded with the results)")
        load_ = (f"load {d['load_before'][0]:.1f} before" if d.get("load_before") else "") + (
            f", {d['load_after'][0]:.1f} after" if d.get("load_after") else "")
        if load_:
            parts.append(load_)
        parts.append(f"steal {d['steal_fraction']:.1%}" if d.get("steal_fraction") is not None
                     else "steal not recorded")
        lines.append(f"- `{name}`: " + "; ".join(parts))
    return lines


def _single(datas, names):
    if len(datas) != 1:
        raise ResultsError(f"{','.join(names)}: this renderer takes one file")
    return datas[0], names[0]


def _report(fn_name):
    def render(datas, names, **_):
        report = _mod("report")
        d, name = _single(datas, names)
        try:
            return getattr(report, fn_name)(d)
        except KeyError as e:
            raise ResultsError(f"{name}: no key {e.args[0]!r} ({fn_name})") from None
    return render


def network_table(datas, names, **_):
    network_report = _mod("network_report")
    d, name = _single(datas, names)
    try:
        return network_report.table(d)
    except KeyError as e:
        raise ResultsError(f"{name}: no key {e.args[0]!r} (network table)") from None


def network_runs(datas, names, by="cycle", backend=None, **_):
    """One line per file and (backend, compression, accumulation): the varied setting ``by`` → efficiency
    (samples/s) in the order the rows ran, and the quiet micro-batch ratios where the rows kept step
    times; ``backend=NAME`` keeps that backend's rows only."""
    network_report = _mod("network_report")
    label = {"cycle": network_report.cycle,
             "bucket": lambda r: str(r.get("bucket_mb") or "default"),
             "view": lambda r: "on" if r.get("bucket_view", True) else "off",
             "accum": lambda r: str(r.get("accum") or 1)}
    if by not in label:
        raise ResultsError(f"network-runs: unknown by={by} (one of {', '.join(label)})")
    lines = ["| results file (commit, steal) | backend | compression | accumulation | "
             f"{by} → efficiency (samples/s), in run order | quiet micro-batch ratio, same order |",
             "|---|---|---|---|---|---|"]
    for d, name in zip(datas, names):
        rows, one = _need(d, "rows", name), _need(d, "one_host", name)
        groups = {}
        for i, r in enumerate(rows):
            if backend and r["backend"] != backend:
                continue
            groups.setdefault((r["backend"], r["compression"] or "none", r.get("accum") or 1), []).append(i)
        steal = f"{d['steal_fraction']:.1%}" if d.get("steal_fraction") is not None else "not recorded"
        for (group_backend, comp, accum), idx in groups.items():
            runs = ", ".join(f"{label[by](rows[i])} → **{rows[i]['efficiency']:.2f}** ({rows[i]['samples_per_s']:.1f})"
                             for i in idx)
            quiet = [network_report.quiet(rows[i], one[i] if isinstance(one, list) else None) for i in idx]
            quiet_text = ", ".join(quiet) if any(q != "–" for q in quiet) else "–"
            lines.append(f"| `{name}` ({d['commit']}, {steal}) | {group_backend} | {comp} | {accum} | {runs} "
                         f"| {quiet_text} |")
    return lines


def memory_table(datas, names, **_):
    memory_layouts = _mod("memory_layouts")
    d, name = _single(datas, names)
    return memory_layouts.table(_need(d, "rows", name)).split("\n")


def streaming_table(datas, names, **_):
    streaming = _mod("streaming")
    d, name = _single(datas, names)
    return streaming.table(_need(d, "rows", name)).split("\n")


def hotpath_compile(datas, names, **_):
    """Eager vs compiled (hotpath.json), and the one-process profile (hotpath_profile.json)."""
    if len(datas) != 2:
        raise ResultsError("hotpath-compile takes hotpath.json,hotpath_profile.json")
    (h, hn), (p, pn) = zip(datas, names)
    e = _need(h, "eager_vs_compiled", hn)
    per = ", ".join(f"{x:.3f}" for x in e["compiled_over_eager_per_repeat"])
    comp = ", ".join(f"{x:.0f}" for x in e["compile_s_per_repeat"])
    steps = len(_need(p, "step_times_s", pn)["eager"]) - p["settings"]["warmup"]
    return [f"| ({e['launcher']}, torch backend) | eager | compiled ({h['settings']['compile_backend']}) |",
            "|---|---|---|",
            f"| steady step, median over repeats | {e['eager_step_s']:.3f} s | {e['compiled_step_s']:.3f} s |",
            f"| compiled / eager, paired per repeat | | {per} → **median {e['compiled_over_eager']:.3f}** |",
            f"| compile time (cold cache), per repeat | | {comp} s |",
            f"| one process (bench/hotpath/hotpath_profile.py), {steps} paired steps "
            f"| {p['median_step_s']['eager']:.3f} s | "
            f"{p['median_step_s']['compiled']:.3f} s (**{p['median_paired_ratio']:.3f}** ×); first step "
            f"{p['first_step_s']['compiled']:.1f} s |"]


def paired_table(datas, names, key="facade_vs_native", **_):
    """Facade vs native paired steps per backend (hotpath.json's facade_vs_native)."""
    d, name = _single(datas, names)
    lines = ["| backend | facade step | native step | facade / native, median of the paired steps [quartiles] |",
             "|---|---|---|---|"]
    for b, r in _need(d, key, name).items():
        lines.append(f"| {b} | {r['facade_step_s']:.3f} s | {r['native_step_s']:.3f} s | **{r['ratio']:.3f}** "
                     f"[{r['ratio_iqr'][0]:.3f}-{r['ratio_iqr'][1]:.3f}] ({r['paired_steps']} pairs) |")
    return lines


def exit_table(datas, names, **_):
    """Exit crashes per launcher from bench/exit/exit_stress.py's files."""
    lines = ["| commit | launcher | launches | exit crashes | other failures | minutes | results file |",
             "|---|---|---|---|---|---|---|"]
    for d, name in zip(datas, names):
        for launcher, r in _need(d, "launchers", name).items():
            lines.append(f"| {d['commit']} | {launcher} | {r['launches']} | **{r['exit_crashes']}** | {r['failures']} "
                         f"| {r['seconds'] / 60:.1f} | `{name}` |")
    return lines


def parity_table(datas, names, **_):
    """bench/compression/compression_parity.py's rows: loss differences and test accuracy, float32 vs compressed."""
    lines = ["| backend | compression | largest relative loss difference (first steps / all steps) | "
             "test accuracy float32 → compressed | difference, points | loss tolerance | commit, results file |",
             "|---|---|---|---|---|---|---|"]
    for d, name in zip(datas, names):
        for r in _need(d, "rows", name):
            first = f"{r['max_loss_rel_diff']:.1e}" + (f" ({r['first_steps']} steps)" if "first_steps" in r else "")
            alls = f" / {r['max_loss_rel_diff_all_steps']:.1e} ({r['steps']} steps)" \
                if "max_loss_rel_diff_all_steps" in r else ""
            acc32, acc16 = r["float32"]["test_accuracy"], r["compressed"]["test_accuracy"]
            lines.append(f"| {r['backend']} | {r['compression']} | {first}{alls} | {acc32:.2%} → {acc16:.2%} "
                         f"| **{r['accuracy_points_diff']:+.2f}** | "
                         f"{d['loss_rtol']:g} relative | {d['commit']}, `{name}` |")
    return lines


def accuracy_seeds(datas, names, **_):
    """Per configuration and seed: seconds and CPU seconds to the threshold, the optimizer step of the
    first evaluation at or above it (evaluations every ``eval_every`` steps), and the ratio to the
    reference configuration's run of the same seed."""
    d, name = _single(datas, names)
    threshold, every = _need(d, "threshold", name), _need(d, "eval_every", name)
    runs = _need(d, "runs", name)
    lines = ["| configuration | seed | s to threshold | CPU s to threshold | step of the first crossing | "
             "time / the reference's, same seed |", "|---|---|---|---|---|---|"]
    for config, rs in runs.items():
        ref = runs[d["summary"][config]["reference"]]
        for r in rs:
            step = next(((i + 1) * every for i, p in enumerate(r["curve"]) if p[1] >= threshold), None)
            mine = next(x for x in ref if x["seed"] == r["seed"])
            ratio = "–" if r["time_to_threshold"] is None or mine["time_to_threshold"] is None else \
                f"{r['time_to_threshold'] / mine['time_to_threshold']:.2f}"
            lines.append(f"| {config} | {r['seed']} | {r['time_to_threshold']:.0f} | {r['cpu_to_threshold']:.0f} | "
                         f"{step if step is not None else 'not reached'} | {ratio} |")
    return lines


def profile_table(datas, names, **_):
    """hotpath_profile.json's top operators by self CPU time, eager and compiled, with their share."""
    d, name = _single(datas, names)
    prof = _need(d, "profile", name)
    top = {k: {t["op"]: t["self_cpu_ms"] for t in prof[k]["top"]} for k in ("eager", "compiled")}
    total = {k: prof[k]["self_cpu_total_ms"] for k in ("eager", "compiled")}
    lines = ["| operator | eager self CPU ms (share) | compiled self CPU ms (share) |", "|---|---|---|"]
    ops = list(dict.fromkeys([*top["eager"], *top["compiled"]]))
    for op in ops:
        cells = [f"{top[k][op]:.0f} ({top[k][op] / total[k]:.0%})" if op in top[k] else "–"
                 for k in ("eager", "compiled")]
        label = "inductor's compiled graph" if op.startswith("## Call CompiledFxGraph") else f"`{op}`"
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    lines.append(f"| **all operators** | {total['eager']:.0f} | {total['compiled']:.0f} |")
    return lines


def suite_budget(datas, names, **_):
    """docs/testing.md's budget of the suite: bench/suite_time/suite_time.py's lines from its results file."""
    d, name = _single(datas, names)
    try:
        return _mod("suite_time").table(d)
    except KeyError as e:
        raise ResultsError(f"{name}: no key {e.args[0]!r} (suite-budget)") from None


RENDERERS = {
    "provenance": provenance,
    "suite-budget": suite_budget,
    "overhead-table": _report("overhead_table"),
    "finite-check": _report("finite_check_lines"),
    "collectives-table": _report("collectives_table"),
    "scaling-table": _report("scaling_table"),
    "accuracy-table": _report("accuracy_table"),
    "accuracy-seeds": accuracy_seeds,
    "network-table": network_table,
    "network-runs": network_runs,
    "memory-table": memory_table,
    "streaming-table": streaming_table,
    "hotpath-compile": hotpath_compile,
    "paired-table": paired_table,
    "profile-table": profile_table,
    "exit-table": exit_table,
    "parity-table": parity_table,
}


def gpu_checks(root: Path = ROOT) -> list:
    """docs/gpus.md's table of ``make gpu-check``: the newest bench/gpu/results/gpu_check_<date>.json (each
    check, what it checks, its result and figure, then the file's provenance); before any is recorded,
    every check of unified_dist/checks/gpu.py listed as not yet run on a GPU."""
    from unified_dist.checks.gpu import CHECKS, figure_text

    what = {name: text for name, _, text in CHECKS}
    files = sorted((Path(root) / GPU_CHECKS).glob("gpu_check_*.json"))
    if not files:
        return ["No run of `make gpu-check` on a GPU is recorded yet: these paths are **not yet run** on a GPU.",
                "", *(f"- `{name}`: {text}" for name, text in what.items())]
    d, name = json.loads(files[-1].read_text()), f"{GPU_CHECKS}/{files[-1].name}"
    lines = [f"`make gpu-check` on {_need(d, 'device', name)}, {_need(d, 'date', name)} (torch {d['torch']}, "
             f"CUDA {d['cuda']}): {d['passed']} of {d['total']} checks passed in {d['wall_s']:.0f} s.", "",
             "| check | what it checks | result | figure | seconds |", "|---|---|---|---|---|"]
    for c in _need(d, "checks", name):
        figure = figure_text(c.get("figure")) if c.get("figure") is not None else c.get("detail", "")
        seconds = f"{c['seconds']:.1f}" if isinstance(c.get("seconds"), (int, float)) else "–"
        cells = [f"`{c['name']}`", what.get(c["name"], ""), c["status"], figure, seconds]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return [*lines, "", *provenance([d], [name])]


LATEST = {"summary": lambda root: _mod("summary").lines(root), "gpu-checks": gpu_checks}
"""Renderers of ``<!-- results: - NAME -->``: they find their own files under ``root``."""


def block(files: str, renderer: str, args: str = "", root: Path = ROOT) -> str:
    names = files.split(",")
    if files == "-" and renderer in LATEST:
        return "\n".join(LATEST[renderer](root))
    if renderer not in RENDERERS:
        raise ResultsError(f"<!-- results: {files} {renderer} -->: no renderer {renderer!r}")
    datas = [load(n, root) for n in names]
    kwargs = dict(a.split("=", 1) for a in args.split())
    try:
        return "\n".join(RENDERERS[renderer](datas, names, **kwargs))
    except KeyError as e:
        raise ResultsError(f"{','.join(names)}: no key {e.args[0]!r} ({renderer})") from None


def render(markdown: str, root: Path = ROOT) -> str:
    """``markdown`` with every marker replaced by what the results files under ``root`` hold."""
    markdown = BLOCK.sub(lambda m: "\n".join(m["indent"] + line if line else line for line in
                                              block(m["files"], m["renderer"], m["args"], root).split("\n")),
                         markdown)
    markdown = INLINE.sub(lambda m: inline(m["file"], m["path"], m["fmt"], root), markdown)
    left = re.search(r"<!-- results:.*?-->|\{\{ results:.*?\}\}", markdown)
    if left:
        raise ResultsError(f"malformed results marker: {left.group(0)[:120]}")
    return markdown


# --- plots ---------------------------------------------------------------------------------------


def _plot_network(data, out):
    network_report = _mod("network_report")
    if not network_report.plot(data, out):
        raise ResultsError("bench/network/results/network.json: fewer than two link rates, no plot")


def _plot(module: str, fn: str):
    def draw(data, out):
        return getattr(_mod(module), fn)(data, out)
    return draw


PLOTS = {  # site path under benchmarks/plots/ -> (results file, drawing function(data, file object))
    "step_time.png": ("bench/step/results/overhead.json", _plot("report", "step_time_plot")),
    "collectives.png": ("bench/collectives/results/collectives.json", _plot("report", "collectives_plot")),
    "scaling.png": ("bench/step/results/scaling.json", _plot("report", "scaling_plot")),
    "accuracy_vs_time.png": ("bench/time_to_accuracy/results/accuracy.json", _plot("report", "accuracy_plot")),
    "network_efficiency.png": ("bench/network/results/network.json", _plot_network),
}


def plot_bytes(name: str, root: Path = ROOT) -> bytes:
    """The PNG ``name`` of ``PLOTS``, drawn from its results file."""
    source, draw = PLOTS[name]
    data = load(source, root)
    out = io.BytesIO()
    try:
        draw(data, out)
    except KeyError as e:
        raise ResultsError(f"{source}: no key {e.args[0]!r} (plot {name})") from None
    return out.getvalue()


# --- MkDocs events -------------------------------------------------------------------------------


def on_files(files, config):
    from mkdocs.structure.files import File
    for name in PLOTS:
        files.append(File.generated(config, f"benchmarks/plots/{name}", content=plot_bytes(name)))
    return files


def on_page_markdown(markdown, page, config, files):
    if "results:" not in markdown:
        return markdown
    try:
        return render(markdown)
    except ResultsError as e:
        raise ResultsError(f"{page.file.src_uri}: {e}") from None
