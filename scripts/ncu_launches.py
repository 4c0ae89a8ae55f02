"""Summarises Nsight Compute's metrics per launch, as scripts/ncu.sh writes
them with NCU_LAUNCHES=1 (ncu --import REPORT --csv --page raw
--print-units base): consecutive launches of one kernel on one grid are a
run (the calls of one timed loop, each rank's call of a ring step), and
each run prints its launch count and its means per launch of the metrics
it has: time, SM cycles active over elapsed, warp instructions, DRAM
bytes and L2 hit rate.

    python3 scripts/ncu_launches.py ncu-1.csv

kernels/attention_hopper.md ("The walk's order, measured by Nsight
Compute") reads its lab table from this summary: a run of the ring's
kernel over the core's run of the same row.
"""

import csv
import sys

# The metrics the summary reads, by the column Nsight Compute names them.
TIME = "gpu__time_duration.sum"  # ns
ACTIVE = "sm__cycles_active.avg"
ELAPSED = "sm__cycles_elapsed.max"
INSTRUCTIONS = "smsp__inst_executed.sum"
DRAM = ("dram__bytes_read.sum", "dram__bytes_write.sum")
L2_HITS = "lts__t_sector_hit_rate.pct"


def launches(rows):
    """The launches of a raw CSV page: one dict per launch, the metrics as
    floats (absent ones left out), plus "kernel" and "grid"."""
    header = None
    out = []
    for row in rows:
        if header is None:
            if row and row[0] == "ID":
                header = row
            continue
        if len(row) != len(header) or not row[0].strip().isdigit():
            continue  # the units row, or a message
        at = dict(zip(header, row))
        launch = {"kernel": at.get("Kernel Name", "?"), "grid": at.get("Grid Size", "?")}
        for name, value in at.items():
            try:
                launch[name] = float(value.replace(",", ""))
            except ValueError:
                pass
        out.append(launch)
    return out


def runs(ls):
    """Groups consecutive launches of one kernel on one grid."""
    out = []
    for launch in ls:
        key = (launch["kernel"], launch["grid"])
        if out and out[-1][0] == key:
            out[-1][1].append(launch)
        else:
            out.append((key, [launch]))
    return out


def mean(run, name):
    vals = [launch[name] for launch in run if name in launch]
    return sum(vals) / len(vals) if vals else None


def summary(run):
    """One run's figures, as text."""
    parts = [f"n={len(run):3d}"]
    t = mean(run, TIME)
    if t is not None:
        parts.append(f"{t / 1e6:8.3f} ms a launch")
    active, elapsed = mean(run, ACTIVE), mean(run, ELAPSED)
    if active is not None and elapsed:
        parts.append(f"SM active {100 * active / elapsed:5.1f}%")
    ins = mean(run, INSTRUCTIONS)
    if ins is not None:
        parts.append(f"{ins / 1e9:.3f} G instructions")
    dram = [mean(run, name) for name in DRAM]
    if all(d is not None for d in dram):
        parts.append(f"DRAM {sum(dram) / 1e9:.3f} GB")
    hits = mean(run, L2_HITS)
    if hits is not None:
        parts.append(f"L2 hits {hits:4.1f}%")
    return "  ".join(parts)


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    with open(argv[1], newline="") as f:
        ls = launches(csv.reader(f))
    if not ls:
        print(f"{argv[1]}: no launches (is it ncu's raw CSV page?)", file=sys.stderr)
        return 1
    print(f"{len(ls)} launches")
    for (kernel, grid), run in runs(ls):
        print(f"{kernel:28s} {grid:14s} {summary(run)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
