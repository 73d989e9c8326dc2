"""Where a kernel's warps wait, from Nsight Compute's SASS source page (no Nsight Compute needed).

    ncu --import report.ncu-rep --page source --csv --print-source sass > source.csv   # on the GPU box
    python -m qlabench_tools.kernels.ncu_stalls source.csv[.xz] [--top 25]

Reads the first kernel of the export. Prints the stall reasons summed over the kernel, the same per code region (a region starts at
each ``USETMAXREG``: the roles of a warp-specialised kernel), and the instructions with the most
stall samples with their two main reasons. ``qlabench profile --ncu --ncu-set full`` with the
device scripts' PROFILES kernel regex writes ``source.csv`` next to the report.
"""

import argparse
import csv
import io
import lzma
import sys


def load(path: str) -> list[dict]:
    raw = lzma.open(path, "rt") if path.endswith(".xz") else open(path, newline="")
    rows = list(csv.reader(io.StringIO(raw.read())))
    i = next((n for n, r in enumerate(rows) if r and r[0] == "Address"), None)
    if i is None:  # an export that failed holds only its error text
        return []
    hdr = rows[i]
    out = []
    for r in rows[i + 1 :]:  # the first kernel's rows; a second kernel's block starts with its own header
        if r and r[0] in ("Kernel Name", "Address"):
            break
        if len(r) == len(hdr):
            out.append(dict(zip(hdr, r)))
    out = [d for d in out if _is_hex(d["Address"])]
    out.sort(key=lambda d: int(d["Address"], 16))
    return out


def _is_hex(s: str) -> bool:
    try:
        int(s, 16)
        return True
    except ValueError:
        return False


def num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source_csv")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    data = load(a.source_csv)
    if not data:
        print("no SASS rows found", file=sys.stderr)
        return 1
    stalls = [k for k in data[0] if k.startswith("stall_") and "Not Issued" not in k]
    samples = "Warp Stall Sampling (All Samples)"
    total = sum(num(d[samples]) for d in data) or 1.0
    by = {s: sum(num(d[s]) for d in data) for s in stalls}
    print(f"{len(data)} instructions, {total:.0f} stall samples")
    for s, v in sorted(by.items(), key=lambda x: -x[1])[:8]:
        print(f"  {s[6:]:18s} {v:9.0f} {100 * v / total:5.1f}%")
    regions, cur = [], []
    for d in data:
        if "USETMAXREG" in d["Source"] and cur:
            regions.append(cur)
            cur = []
        cur.append(d)
    regions.append(cur)
    base = int(data[0]["Address"], 16)
    print("\nby region (a region starts at each USETMAXREG):")
    for r in regions:
        smp = sum(num(d[samples]) for d in r)
        ins = sum(num(d.get("Instructions Executed", "0")) for d in r)
        top = sorted(((s, sum(num(d[s]) for d in r)) for s in stalls), key=lambda x: -x[1])[:3]
        head = next((d["Source"].split()[0] for d in r if "USETMAXREG" in d["Source"]), "start")
        print(f"  +{int(r[0]['Address'], 16) - base:05x} {head[:24]:24s} samples {100 * smp / total:5.1f}%  "
              f"instructions {ins:12.0f}  " + ", ".join(f"{s[6:]} {v:.0f}" for s, v in top))
    print(f"\ntop {a.top} instructions by stall samples:")
    for d in sorted(data, key=lambda d: -num(d[samples]))[: a.top]:
        top = sorted(((s, num(d[s])) for s in stalls), key=lambda x: -x[1])[:2]
        print(f"  +{int(d['Address'], 16) - base:05x} {num(d[samples]):8.0f}  {d['Source'][:60]:60s} "
              + ", ".join(f"{s[6:]} {v:.0f}" for s, v in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
