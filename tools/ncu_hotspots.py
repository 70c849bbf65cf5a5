"""The instructions where a kernel's warps stall most, from Nsight Compute's source page as CSV:

    ncu --set full --import-source no -k regex:grad_weight_fed --launch-skip 1 --launch-count 1 -o dw \
        python3 tools/run_once.py grad_weight
    ncu -i dw.ncu-rep --page source --csv --print-source sass > dw.csv
    python3 tools/ncu_hotspots.py dw.csv --top 40

Prints the total of the stall samples, then the top instructions (address, share of the samples, times executed,
SASS, and the stall-reason columns that hold samples there), then every instruction above --floor in address order,
so that a loop's share reads as one run of lines. Rows that are not instructions (a kernel's name line, blank lines,
a second kernel's header) are skipped; a file with no header naming the columns below is an error.
"""
import argparse
import csv
import sys

ADDRESS, SOURCE = "Address", "Source"
SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _number(text):
    try:
        return float(text.replace(",", "")) if text else 0.0
    except ValueError:
        return None


def read_rows(lines):
    """[(address, sass, samples, executed, {reason: samples})] of every instruction row, in file order."""
    rows, head = [], None
    for row in csv.reader(lines):
        if SAMPLES in row and ADDRESS in row:
            head = {name: i for i, name in enumerate(row)}
            reasons = [name for name in row if "stall" in name.lower() and not name.startswith("Warp Stall Sampling")]
            continue
        if head is None or len(row) <= head[ADDRESS]:
            continue
        try:
            int(row[head[ADDRESS]], 16)
        except ValueError:
            continue
        cell = lambda name: row[head[name]] if name in head and head[name] < len(row) else ""  # noqa: E731
        samples = _number(cell(SAMPLES))
        if samples is None:
            continue
        executed = _number(cell(EXECUTED)) or 0.0
        by_reason = {name: _number(cell(name)) for name in reasons}
        rows.append((cell(ADDRESS), cell(SOURCE), samples, executed, {k: v for k, v in by_reason.items() if v}))
    if head is None:
        raise SystemExit(f"ncu_hotspots.py: expected a CSV header with {ADDRESS!r} and {SAMPLES!r} "
                         "(ncu --page source --csv), found none")
    return rows


def report(rows, top, floor):
    total = sum(r[2] for r in rows) or 1.0
    out = [f"{len(rows)} instructions, {total:.0f} stall samples"]
    for address, sass, samples, executed, reasons in sorted(rows, key=lambda r: -r[2])[:top]:
        why = ", ".join(f"{k} {v:.0f}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])[:3])
        line = f"{address} {samples / total:6.2%} exec {executed:>10.0f}  {sass[:70]}"
        out.append(line + (f"  [{why}]" if why else ""))
    out.append(f"--- in address order, above {floor:.1%} of the samples")
    out += [f"{a} {s / total:6.2%} exec {e:>10.0f}  {src[:80]}" for a, src, s, e, _ in rows if s / total > floor]
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu's source page as CSV ('-' for standard input)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--floor", type=float, default=0.002, help="share of the samples an instruction needs in the "
                   "address-order list (default 0.2%%)")
    args = p.parse_args(argv)
    with (sys.stdin if args.csv == "-" else open(args.csv, newline="", errors="replace")) as f:
        print(report(read_rows(f), args.top, args.floor))
    return 0


if __name__ == "__main__":
    sys.exit(main())
