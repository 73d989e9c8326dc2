"""Pick the fastest forward variant from a check_fwd.json (kernels/dev/check_fwd.py's output).

    python kernels/dev/pick_variant.py $OUT/check_fwd.json ["prep=rt;rowexp=1;prep=rt,rowexp=1"]

A candidate qualifies only if every correctness case it ran passed and every timed case has an
auto-split time (split_tokens None) for it and for "default". Prints one line per candidate
(cases passed, geomean and worst time ratio default / candidate; > 1 = faster) to stderr and the
winner's spec to stdout: the candidate with the highest geomean ratio if that ratio is above
``--min-gain`` (default 1.02) and no case is slower than ``--max-loss`` (default 0.97), else
"default". Used by the device scripts to choose the variant a sweep runs (QLABENCH_GDN_VARIANT).
"""

import argparse
import json
import math
import sys


def ratios(data: dict, candidate: str) -> tuple[bool, int, dict]:
    """(all cases passed, cases run, {timed case: default ms / candidate ms})."""
    res = [r for r in data.get("results", []) if r.get("case", "").endswith("@" + candidate)]
    ok = bool(res) and all(r.get("ok") for r in res)
    auto = {}
    for t in data.get("timings", []):
        if t.get("split_tokens") is None and "@" in t.get("case", ""):
            name, var = t["case"].split("@", 1)
            auto.setdefault(name, {})[var] = float(t["latency_ms"])
    out = {n: v["default"] / v[candidate] for n, v in auto.items() if "default" in v and candidate in v}
    timed_for_default = [n for n, v in auto.items() if "default" in v]
    if len(out) < len(timed_for_default):
        ok = False  # a timed case is missing for the candidate: do not pick it
    return ok, len(res), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check_json")
    ap.add_argument("candidates", nargs="?", default="", help='";"-separated specs (default: every variant in the file)')
    ap.add_argument("--min-gain", type=float, default=1.02)
    ap.add_argument("--max-loss", type=float, default=0.97)
    a = ap.parse_args(argv)
    try:
        data = json.load(open(a.check_json))
    except (OSError, ValueError) as e:
        print(f"pick_variant: cannot read {a.check_json}: {e}; using default", file=sys.stderr)
        print("default")
        return 0
    cands = [c for c in a.candidates.split(";") if c]
    if not cands:
        cands = sorted({r["case"].split("@", 1)[1] for r in data.get("results", []) if "@" in r.get("case", "")})
    best, best_gm = "default", 1.0
    for c in cands:
        if c == "default":
            continue
        ok, n, rs = ratios(data, c)
        gm = math.exp(sum(math.log(r) for r in rs.values()) / len(rs)) if rs else float("nan")
        worst = min(rs.values()) if rs else float("nan")
        print(
            f"{c:32s} {'PASS' if ok else 'FAIL'} cases={n} timed={len(rs)} geomean={gm:.3f}x worst={worst:.3f}x "
            + " ".join(f"{k}={v:.2f}" for k, v in sorted(rs.items())),
            file=sys.stderr,
        )
        if ok and rs and gm > best_gm and gm >= a.min_gain and worst >= a.max_loss:
            best, best_gm = c, gm
    print(best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
