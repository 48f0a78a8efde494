"""Turn the results of bench/shared/run.py's four parts into bench/summary.md, and their PNG plots beside
the results they draw (bench/step/results/, bench/collectives/results/, bench/time_to_accuracy/results/).

    python bench/shared/report.py [--short]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from run import NO_FINITE_CHECK  # noqa: E402  (bench/shared/run.py: the variant's key in the results)

BENCH = Path(__file__).resolve().parents[1]
FOLDER = {"overhead": "step", "scaling": "step", "collectives": "collectives", "accuracy": "time_to_accuracy"}
"""The benchmark folder (under bench/) of each part's results."""


def results(name: str) -> Path:
    """The results folder of part ``name`` (``overhead_short`` is overhead's)."""
    return BENCH / FOLDER[name.removesuffix("_short")] / "results"


def load(name: str):
    path = results(name) / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def overhead_table(data) -> list:
    """The facade-overhead table (Markdown lines) of an overhead.json."""
    res = data["results"]
    lines = ["| backend | facade s/step | native s/step | ratio (paired) | ratio (separate launches) "
             "| facade peak RSS/rank MiB | native peak RSS/rank MiB | exit crashes facade/native |",
             "|---|---|---|---|---|---|---|---|"]
    for b, r in res.items():
        iqr = f" [{r['ratio_iqr'][0]:.3f}-{r['ratio_iqr'][1]:.3f}]" if "ratio_iqr" in r else ""
        crashes = r.get("exit_crashes", {})
        lines.append(f"| {b} | {r['facade_step_s']:.3f} | {r['native_step_s']:.3f} | **{r['ratio']:.3f}**{iqr} | "
                     f"{r.get('separate_launch_ratio', float('nan')):.3f} | {r['facade_peak_rss_mib']:.0f} | "
                     f"{r['native_peak_rss_mib']:.0f} | {crashes.get('facade', 0)}/{crashes.get('native', 0)} "
                     f"of {r.get('reps', 0)} |")
    return lines


def finite_check_lines(data) -> list:
    """One sentence per backend whose separate launches also ran without the finite-loss check."""
    lines = []
    for b, r in data["results"].items():
        if "finite_check_off_vs_on" in r:
            meds = {v: statistics.median(m) for v, m in r["separate_launch_medians"].items()}
            lines += [f"{b}, separate launches: median step with the finite-loss check {meds['facade']:.3f} s, "
                      f"without it (`UNIFIED_DIST_CHECK_FINITE=0`) {meds[NO_FINITE_CHECK]:.3f} s "
                      f"(x{r['finite_check_off_vs_on']:.3f}), native {meds['native']:.3f} s.", ""]
    return lines


def step_time_plot(data, out) -> None:
    """Bar chart of facade and native median step times per backend, saved to ``out`` (a path or a file)."""
    res = data["results"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(res)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [res[n]["native_step_s"] for n in names], 0.4, label="native")
    ax.bar([i + 0.2 for i in x], [res[n]["facade_step_s"] for n in names], 0.4, label="unified_dist")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("median s / training step")
    ax.set_title("BERT (MiniLM-L6) step, 2 processes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)


def overhead_section(data, suffix, lines):
    lines += ["## Facade overhead per training step (2 processes, 1 thread each)", "",
              "Ratio: median of facade/native step times alternating in one launch (quartiles in brackets); "
              "separate launches: ratio of per-launch medians (noisier). Peak RSS from the separate launches.", "",
              *overhead_table(data), ""]
    lines += finite_check_lines(data)
    step_time_plot(data, results("overhead") / f"step_time{suffix}.png")
    lines += [f"![step time](step/results/step_time{suffix}.png)", ""]


def collectives_table(data) -> list:
    """The collectives table (Markdown lines) of a collectives.json: facade vs raw call per backend and size."""
    lines = ["| backend | size KB | all_reduce ratio | all_gather ratio | facade CPU +µs/call (reduce, gather) "
             "| uneven/even gather | check mode cost | all_reduce GB/s |",
             "|---|---|---|---|---|---|---|---|"]

    def iqr(r, key):
        q = r.get(key)
        return f" [{q[0]:.2f}-{q[1]:.2f}]" if q else ""

    for b, rows in data["results"].items():
        for r in rows:
            cpu = (f"{r['all_reduce_cpu_overhead_us']:+.0f}, {r['all_gather_cpu_overhead_us']:+.0f}"
                   if "all_reduce_cpu_overhead_us" in r else "")
            lines.append(f"| {b} | {r['size_kb']} | {r['all_reduce_ratio']:.3f}{iqr(r, 'all_reduce_ratio_iqr')} | "
                         f"{r['all_gather_ratio']:.3f}{iqr(r, 'all_gather_ratio_iqr')} | {cpu} | "
                         f"{r['uneven_vs_even_ratio']:.3f} | {r['checkmode_ratio']:.3f} | {r['all_reduce_GBps']:.2f} |")
    return lines


def collectives_plot(data, out) -> None:
    """all_reduce throughput against size, facade and raw, per backend, saved to ``out``."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for b, rows in data["results"].items():
        sizes = [r["size_kb"] for r in rows]
        ax.plot(sizes, [r["size_kb"] * 1024 / r["facade_all_reduce_s"] / 1e9 for r in rows], "o-", label=f"{b} facade")
        ax.plot(sizes, [r["size_kb"] * 1024 / r["raw_all_reduce_s"] / 1e9 for r in rows], "x--", label=f"{b} raw")
    ax.set_xscale("log")
    ax.set_xlabel("tensor size (KB)")
    ax.set_ylabel("all_reduce throughput (GB/s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)


def collectives_section(data, suffix, lines):
    lines += ["## Collectives: facade vs raw backend call (2 processes)", "",
              "Wall ratios: medians of interleaved blocks (quartiles of the per-round ratio in brackets). "
              "CPU: the calling thread's CPU time per call, facade minus raw (what the facade adds).", "",
              *collectives_table(data), ""]
    collectives_plot(data, results("collectives") / f"collectives{suffix}.png")
    lines += [f"![collectives](collectives/results/collectives{suffix}.png)", ""]


def scaling_table(data) -> list:
    """The scaling table (Markdown lines) of a scaling.json."""
    lines = ["| backend | 1 process | 2 processes | efficiency |", "|---|---|---|---|"]
    for b, r in data["results"].items():
        lines.append(f"| {b} | {r['samples_per_s_1']:.1f} | {r['samples_per_s_2']:.1f} | {r['efficiency']:.2f} |")
    return lines


def scaling_plot(data, out) -> None:
    """Samples/s with 1 and 2 processes per backend, with the efficiency written over each pair, saved to ``out``."""
    res = data["results"]
    names = list(res)
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([i - 0.2 for i in x], [res[n]["samples_per_s_1"] for n in names], 0.4, label="1 process")
    ax.bar([i + 0.2 for i in x], [res[n]["samples_per_s_2"] for n in names], 0.4, label="2 processes")
    for i, n in zip(x, names):
        ax.annotate(f"efficiency {res[n]['efficiency']:.2f}", (i, res[n]["samples_per_s_2"]),
                    textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    ax.set_ylim(0, 1.15 * max(res[n]["samples_per_s_2"] for n in names))
    ax.set_xticks(list(x), names)
    ax.set_ylabel("training samples/s")
    ax.set_title("BERT (MiniLM-L6), 1 thread per process")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)


def scaling_section(data, lines):
    lines += ["## Scaling (training samples/s, 1 thread per process)", "", *scaling_table(data), ""]


def _mean_std(s: dict, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    if s["mean"] is None:
        return "not reached"
    text = fmt.format(s["mean"] * scale) + (f" ± {fmt.format(s['std'] * scale)}" if s["std"] is not None else "")
    return text + ("" if s["n"] == s["of"] else f" ({s['n']} of {s['of']} reached)")


def accuracy_table(data) -> list:
    """The time-to-accuracy table (Markdown lines) of an accuracy.json
    (bench/time_to_accuracy/time_to_accuracy.py's format)."""
    threshold = data.get("threshold", 0.8)
    lines = [f"| configuration | s to ≥ {threshold:.0%} validation | [min–max] | CPU s to ≥ {threshold:.0%} | "
             "final validation accuracy % | final test accuracy % | whole run s | steal % | time vs its reference |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in data["summary"].items():
        t = s["time_to_threshold_s"]
        rng = f"[{t['min']:.0f}–{t['max']:.0f}]" if t["mean"] is not None else "–"
        ratio = (f"{s['time_ratio_vs_reference']:.2f} × wall" if s.get("time_ratio_vs_reference") else "–") + (
            f", {s['cpu_ratio_vs_reference']:.2f} × CPU" if s.get("cpu_ratio_vs_reference") else "")
        cpu = s.get("cpu_to_threshold_s", {})
        steal = s.get("steal_fraction", {})
        lines.append(f"| {name} | {_mean_std(t)} | {rng} | {_mean_std(cpu) if cpu.get('n') else '–'} | "
                     f"{_mean_std(s['final_validation_accuracy'], 100, '{:.2f}')} | "
                     f"{_mean_std(s['test_accuracy'], 100, '{:.2f}')} | "
                     f"{_mean_std(s['wall_s'])} | "
                     f"{_mean_std(steal, 100) if steal.get('n') else '–'} | {ratio} |")
    return lines


def accuracy_plot(data, out) -> None:
    """Validation accuracy against wall time, every run of every configuration, saved to ``out``."""
    threshold = data.get("threshold", 0.8)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colours = {}
    for name, runs in data["runs"].items():
        colour = colours.setdefault(name, f"C{len(colours)}")
        for k, r in enumerate(runs):
            ax.plot([p[0] for p in r["curve"]], [p[1] for p in r["curve"]], ".-", color=colour, alpha=0.7,
                    label=name if k == 0 else None)
    ax.axhline(threshold, color="grey", linestyle=":")
    ax.set_xlabel("wall time from process start (s)")
    ax.set_ylabel("validation accuracy")
    ax.set_ylim(0.5, 0.9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)


def accuracy_section(data, lines):
    threshold = data.get("threshold", 0.8)
    lines += [f"## Time to {threshold:.0%} validation accuracy: the example vs Hugging Face Trainer", "",
              f"Seeds {data['seeds']}, validation every {data['eval_every']} steps; mean ± sample std over seeds "
              "[min–max].", "", *accuracy_table(data), ""]
    accuracy_plot(data, results("accuracy") / "accuracy_vs_time.png")
    lines += ["![accuracy vs wall time](time_to_accuracy/results/accuracy_vs_time.png)", ""]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--short", action="store_true")
    args = p.parse_args()
    suffix = "_short" if args.short else ""
    lines = ["# unified_dist benchmark summary" + (" (short run)" if args.short else ""), ""]
    for name, fn in (("overhead", overhead_section), ("collectives", collectives_section)):
        data = load(name + suffix)
        if data:
            if not any("Machine" in line for line in lines):
                m = data["machine"]
                lines += [f"Machine: {m['cpus']} CPUs ({m['processor']}), {m['platform']}, Python {m['python']}, "
                          f"torch {m['torch']}; {m['date']}.", ""]
            fn(data, suffix, lines)
    data = load("scaling" + suffix)
    if data:
        scaling_section(data, lines)
    data = load("accuracy")
    if data and "summary" in data and not args.short:  # bench/time_to_accuracy/time_to_accuracy.py's per-seed format
        accuracy_section(data, lines)
    (BENCH / f"summary{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
