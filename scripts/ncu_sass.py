"""Summarises the SASS page of an Nsight Compute report, as scripts/ncu.sh
writes it with NCU_SOURCE=1 (ncu --page source --csv --print-source sass):
the share of warp-stall samples by opcode, then the instructions with the
most samples and their top stall reasons.

    python3 scripts/ncu_sass.py ncu-1-sass.csv [TOP]
"""

import collections
import csv
import sys


def kernels(rows):
    """Splits the CSV into (kernel name, header, rows) per profiled kernel."""
    name, header, body = None, None, []
    for row in rows:
        if len(row) >= 2 and row[0] == "Kernel Name":
            if header:
                yield name, header, body
            name, header, body = row[1], None, []
        elif header is None and "Source" in row:
            header = row
        elif header is not None:
            body.append(row)
    if header:
        yield name, header, body


def summarise(name, header, body, top):
    col = {h: i for i, h in enumerate(header)}
    samples = col.get("Warp Stall Sampling (All Samples)")
    if samples is None:
        print(f"{name}: no warp-stall samples in this report")
        return
    reasons = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
    total, by_op, lines = 0.0, collections.Counter(), []
    for row in body:
        try:
            n = float(row[samples] or 0)
        except (ValueError, IndexError):
            continue
        text = row[col["Source"]].strip()
        words = [w for w in text.split() if not w.startswith("@")]
        by_op[words[0].split(".")[0] if words else "?"] += n
        total += n
        why = sorted(((float(row[i] or 0), header[i][len("stall_"):]) for i in reasons), reverse=True)[:3]
        lines.append((n, row[col["Address"]], text, why))
    if total == 0:
        print(f"{name}: no samples")
        return
    print(f"{name}: {int(total)} warp-stall samples over {len(lines)} instructions")
    print("  by opcode: " + ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in by_op.most_common(12)))
    for n, addr, text, why in sorted(lines, reverse=True)[:top]:
        reasons_text = ", ".join(f"{r} {v:.0f}" for v, r in why if v > 0)
        print(f"  {100 * n / total:5.1f}%  {addr}  {text[:64]:<64}  {reasons_text}")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    with open(sys.argv[1], newline="") as f:
        for name, header, body in kernels(csv.reader(f)):
            summarise(name, header, body, top)


if __name__ == "__main__":
    main()
