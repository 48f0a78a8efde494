"""Turn bench/results/*.json into bench/results/summary.md and PNG plots.

    python bench/report.py [--short]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def load(name: str):
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def overhead_section(data, suffix, lines):
    res = data["results"]
    lines += ["## Facade overhead per training step (2 processes, 1 thread each)", "",
              "Ratio: median of facade/native step times alternating in one launch (quartiles in brackets); "
              "separate launches: ratio of per-launch medians (noisier). Peak RSS from the separate launches.", "",
              "| backend | facade s/step | native s/step | ratio (paired) | ratio (separate launches) "
              "| facade peak RSS/rank MiB | native peak RSS/rank MiB | exit crashes facade/native |",
              "|---|---|---|---|---|---|---|---|"]
    for b, r in res.items():
        iqr = f" [{r['ratio_iqr'][0]:.3f}-{r['ratio_iqr'][1]:.3f}]" if "ratio_iqr" in r else ""
        crashes = r.get("exit_crashes", {})
        lines.append(f"| {b} | {r['facade_step_s']:.3f} | {r['native_step_s']:.3f} | **{r['ratio']:.3f}**{iqr} | "
                     f"{r.get('separate_launch_ratio', float('nan')):.3f} | {r['facade_peak_rss_mib']:.0f} | "
                     f"{r['native_peak_rss_mib']:.0f} | {crashes.get('facade', 0)}/{crashes.get('native', 0)} "
                     f"of {r.get('reps', 0)} |")
    lines.append("")
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
    fig.savefig(RESULTS / f"step_time{suffix}.png", dpi=110)
    plt.close(fig)
    lines += [f"![step time](step_time{suffix}.png)", ""]


def collectives_section(data, suffix, lines):
    res = data["results"]
    lines += ["## Collectives: facade vs raw backend call (2 processes)", "",
              "Wall ratios: medians of interleaved blocks (quartiles of the per-round ratio in brackets). "
              "CPU: the calling thread's CPU time per call, facade minus raw (what the facade adds).", "",
              "| backend | size KB | all_reduce ratio | all_gather ratio | facade CPU +µs/call (reduce, gather) "
              "| uneven/even gather | check mode cost | all_reduce GB/s |",
              "|---|---|---|---|---|---|---|---|"]

    def iqr(r, key):
        q = r.get(key)
        return f" [{q[0]:.2f}-{q[1]:.2f}]" if q else ""

    for b, rows in res.items():
        for r in rows:
            cpu = (f"{r['all_reduce_cpu_overhead_us']:+.0f}, {r['all_gather_cpu_overhead_us']:+.0f}"
                   if "all_reduce_cpu_overhead_us" in r else "")
            lines.append(f"| {b} | {r['size_kb']} | {r['all_reduce_ratio']:.3f}{iqr(r, 'all_reduce_ratio_iqr')} | "
                         f"{r['all_gather_ratio']:.3f}{iqr(r, 'all_gather_ratio_iqr')} | {cpu} | "
                         f"{r['uneven_vs_even_ratio']:.3f} | {r['checkmode_ratio']:.3f} | {r['all_reduce_GBps']:.2f} |")
    lines.append("")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for b, rows in res.items():
        sizes = [r["size_kb"] for r in rows]
        ax.plot(sizes, [r["size_kb"] * 1024 / r["facade_all_reduce_s"] / 1e9 for r in rows], "o-", label=f"{b} facade")
        ax.plot(sizes, [r["size_kb"] * 1024 / r["raw_all_reduce_s"] / 1e9 for r in rows], "x--", label=f"{b} raw")
    ax.set_xscale("log")
    ax.set_xlabel("tensor size (KB)")
    ax.set_ylabel("all_reduce throughput (GB/s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"collectives{suffix}.png", dpi=110)
    plt.close(fig)
    lines += [f"![collectives](collectives{suffix}.png)", ""]


def scaling_section(data, lines):
    lines += ["## Scaling (training samples/s, 1 thread per process)", "",
              "| backend | 1 process | 2 processes | efficiency |", "|---|---|---|---|"]
    for b, r in data["results"].items():
        lines.append(f"| {b} | {r['samples_per_s_1']:.1f} | {r['samples_per_s_2']:.1f} | {r['efficiency']:.2f} |")
    lines.append("")


def accuracy_section(data, lines):
    lines += ["## Time to 80% test accuracy: the example vs Hugging Face Trainer", "",
              "| run | wall s to >= 80% | final accuracy | total wall s |", "|---|---|---|---|"]
    for name, r in data["runs"].items():
        t80 = f"{r['time_to_80']:.0f}" if r.get("time_to_80") is not None else "not reached"
        lines.append(f"| {name} | {t80} | {r['final_accuracy']:.4f} | {r['wall_s']:.0f} |")
    if data.get("ratio_vs_trainer") is not None:
        lines.append(f"\nExample (best) / Trainer time to 80%: **{data['ratio_vs_trainer']:.2f}**")
    lines.append("")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, r in data["runs"].items():
        ax.plot([p[0] for p in r["curve"]], [p[1] for p in r["curve"]], "o-", label=name)
    ax.axhline(0.8, color="grey", linestyle=":")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("test accuracy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "accuracy_vs_time.png", dpi=110)
    plt.close(fig)
    lines += ["![accuracy vs wall time](accuracy_vs_time.png)", ""]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--short", action="store_true")
    args = p.parse_args()
    suffix = "_short" if args.short else ""
    lines = ["# unified_dist benchmark summary" + (" (short run)" if args.short else ""), ""]
    for name, fn in (("overhead", overhead_section), ("collectives", collectives_section)):
        data = load(name + suffix)
        if data:
            if not any("Machine" in l for l in lines):
                m = data["machine"]
                lines += [f"Machine: {m['cpus']} CPUs ({m['processor']}), {m['platform']}, Python {m['python']}, "
                          f"torch {m['torch']}; {m['date']}.", ""]
            fn(data, suffix, lines)
    data = load("scaling" + suffix)
    if data:
        scaling_section(data, lines)
    data = load("accuracy")
    if data and not args.short:
        accuracy_section(data, lines)
    (RESULTS / f"summary{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
