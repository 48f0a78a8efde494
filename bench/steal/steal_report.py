"""Steal share per window from bench/steal/steal_logger.sh's log: when the hypervisor took the cores.

    python bench/steal/steal_report.py LOG [--window 60]

Prints, per window of ``--window`` seconds, the share of all CPU ticks that were stolen, and the
largest and median window.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared"))
from provenance import steal_fraction  # noqa: E402  (bench/shared/provenance.py)


def windows(lines, width):
    """[(start epoch, steal share)] per ``width``-second window of the logged /proc/stat lines."""
    rows = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 10 and parts[1] == "cpu":
            rows.append((int(parts[0]), [int(x) for x in parts[2:10]]))
    out, start = [], 0
    for i in range(1, len(rows)):
        if rows[i][0] - rows[start][0] >= width or i == len(rows) - 1:
            share = steal_fraction(rows[start][1], rows[i][1])
            if share is not None:
                out.append((rows[start][0], share))
            start = i
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log")
    p.add_argument("--window", type=int, default=60)
    args = p.parse_args()
    with open(args.log) as f:
        shares = windows(f, args.window)
    for start, share in shares:
        print(f"{time.strftime('%H:%M:%S', time.gmtime(start))} UTC  steal {share:6.1%}")
    if shares:
        values = [s for _, s in shares]
        print(f"{len(values)} windows: median {statistics.median(values):.1%}, largest {max(values):.1%}")


if __name__ == "__main__":
    main()
