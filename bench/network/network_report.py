"""bench/network/network.py's results JSON as a markdown table and a plot of efficiency against link rate.

    python bench/network/network_report.py [RESULTS_JSON] [--md FILE] [--png FILE]

Defaults: bench/network/results/network.json -> bench/network/results/network.md and network_efficiency.png.
Every row comes from the JSON, which records the commit, the command lines and the tc settings.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from network import quiet_ratio, rate_bits  # noqa: E402  (bench/network/network.py)

RESULTS = Path(__file__).resolve().parent / "results"


def cycle(r: dict) -> str:
    """The row's Horovod cycle: what hvd.init() read where the row recorded it, else what the benchmark set."""
    if r["backend"] != "horovod":
        return "–"
    effective = r.get("horovod_cycle_ms_effective")
    if effective is not None:
        return effective + ("" if r.get("horovod_cycle_ms") else " (facade's)")
    return r.get("horovod_cycle_ms") or "1 (Horovod's)"  # rows made before the facade set one on CPU


def quiet(r: dict, one_host: Optional[dict]) -> str:
    """The row's quiet micro-batch ratio (bench/network/network.py's quiet_ratio) against the 1-host run made
    just before it, where both kept their step times."""
    if one_host is None or "step_times_s" not in r or "step_times_s" not in one_host:
        return "–"
    ratio = quiet_ratio(r, one_host)
    return "–" if ratio is None else f"{ratio:.2f}"


def table(data: dict) -> list:
    one = data["one_host"]
    if isinstance(one, list):  # a 1-host run before every row (its step time is in the row)
        rates = [o["samples_per_s"] for o in one]
        alone = (f"1 host alone, run before each row: {min(rates):.2f}-{max(rates):.2f} samples/s "
                 "(each row's own in its last column but one)")
    else:  # older files: one 1-host run at the start
        alone = f"1 host alone: {one['samples_per_s']:.2f} samples/s ({one['median_step_s']:.3f} s/step, compute only)"
    lines = [f"Commit `{data['commit']}`, `{data['command']}`; load average before/after "
             f"{data['load_before'][0]:.2f}/{data.get('load_after', [float('nan')])[0]:.2f}; steal "
             f"{data.get('steal_fraction', float('nan')):.1%}; {alone}; "
             f"{data['settings']['steps']} timed steps after {data['settings']['warmup']} warm-up, batch "
             f"{data['settings']['batch_size']} x {data['settings']['max_length']} tokens per process; "
             f"link: `{data['rows'][0]['tc'][0].split(' ', 4)[-1] if data['rows'] else ''}` on both sides.", "",
             "| rate | delay | backend | compression | bucket MiB | Horovod cycle ms | bucket view | accum | samples/s "
             "| efficiency | MB/step on the wire "
             "| ring all-reduce bound s | efficiency at the bound, no overlap | serialised all-reduce s "
             "| step s (1 host) | comm hidden | quiet micro-batch 2 hosts / 1 host |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(data["rows"]):
        hidden = "–" if r["comm_hidden_fraction"] is None else f"{r['comm_hidden_fraction']:.2f}"
        lines.append(f"| {r['rate']} | {r['delay']} | {r['backend']} | {r['compression'] or 'none'} | "
                     f"{r.get('bucket_mb') or 'default'} | {cycle(r)} | "
                     f"{'–' if r['backend'] == 'horovod' else ('on' if r.get('bucket_view', True) else 'off')} | "
                     f"{r.get('accum', 1)} | {r['samples_per_s']:.2f} | **{r['efficiency']:.2f}** | "
                     f"{r['wire_bytes_per_step'] / 1e6:.1f} | "
                     f"{r['ring_allreduce_bound_s']:.3f} | {r['efficiency_if_not_overlapped_at_bound']:.2f} | "
                     f"{r['serialised_allreduce_s']:.3f} | {r['median_step_s']:.3f} ({r['median_step_s_1host']:.3f}) | "
                     f"{hidden} | {quiet(r, one[i] if isinstance(one, list) else None)} |")
    return lines


def plot(data: dict, png: Path) -> bool:
    """The efficiency-against-rate plot of the default-setting rows; ``False`` (nothing drawn) when
    the file has tuning rows only or a single rate."""
    series = {}
    for r in data["rows"]:
        if r.get("bucket_mb") or r.get("horovod_cycle_ms") or not r.get("bucket_view", True) or r.get("accum", 1) != 1:
            continue  # tuning rows (one rate): their own table
        series.setdefault((r["backend"], r["compression"] or "none"), []).append(
            (rate_bits(r["rate"]), r["efficiency"]))
    if len({rate for points in series.values() for rate, _ in points}) < 2:
        return False  # one rate (a tuning run): the table says it all
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (backend, comp), points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] / 1e9 for p in points], [p[1] for p in points], marker="o",
                linestyle="-" if comp == "none" else "--", label=f"{backend}, {comp}")
    ax.set_xscale("log")
    ax.set_xlabel("link rate, Gbit/s (tbf on both sides)")
    ax.set_ylabel("scaling efficiency, 2 hosts x 1 process")
    ax.set_ylim(0, 1.05)
    ax.axhline(0.9, color="grey", linewidth=0.8, linestyle=":")
    ax.set_title("MiniLM-L6 training step over a limited link")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="?", default=str(RESULTS / "network.json"))
    p.add_argument("--md", default=None)
    p.add_argument("--png", default=None)
    args = p.parse_args()
    src = Path(args.results)
    data = json.loads(src.read_text())
    md = Path(args.md) if args.md else src.with_suffix(".md")
    base, short = (src.stem[:-len("_short")], "_short") if src.stem.endswith("_short") else (src.stem, "")
    png = Path(args.png) if args.png else src.with_name(f"{base}_efficiency{short}.png")  # *_short.* is ignored
    figure = [f"![efficiency against link rate]({png.name})", ""] if plot(data, png) else []
    md.write_text("\n".join([*table(data), "", *figure]))
    print(f"wrote {md}" + (f" and {png}" if figure else " (one rate or tuning rows only: no plot)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
