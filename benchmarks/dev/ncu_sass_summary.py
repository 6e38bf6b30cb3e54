"""Summarise the per-SASS-line CSV that ``attention_ncu.sh`` writes (``ncu --page source --csv --print-source
sass``) so that two kernels' profiles can be compared side by side: the instruction mix (warp-level instructions
executed per opcode), the warp-stall samples by reason, and for a few reasons the opcodes and execution counts
that carry them.

Warps that a warp-specialised kernel leaves idle (the producer warpgroup's unused warps, parked at the CTA's
final barrier for the whole kernel) are sampled as "stalled at a barrier" on a line that executes once per CTA
or so. They take no issue slot from anyone, so they are counted apart ("parked") and left out of the reasons.
run126 found 24% of the BERT-base forward's samples there, which is most of the "CTA barrier" stall earlier
profiles (run67, run81) showed.

The execution count of a line tells which code it is: in a persistent kernel over T tiles with W warps per
consumer, a line of the steady-state key loop runs T * W * (blocks - peeled) times, a per-tile line T * W, the
producer's per-block waits T * blocks.

Usage: ``python benchmarks/dev/ncu_sass_summary.py A.csv [B.csv ...] [--reasons wait,barrier,long_sb]``
"""
from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _load(path: str) -> tuple[str, list[str], list[list[str]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    name = rows[0][1] if rows and len(rows[0]) > 1 else path
    return name, rows[1], rows[2:]


def _opcode(src: str) -> str:
    toks = src.split()
    if not toks:
        return ""
    op = toks[1] if toks[0].startswith("@") and len(toks) > 1 else toks[0]
    return op.split(".")[0]


def summarise(path: str, reasons: list[str], parked_max_exec: int = 600, top: int = 8) -> str:
    name, hdr, data = _load(path)
    ix = {h: i for i, h in enumerate(hdr)}

    def num(r, key):
        try:
            return float(r[ix[key]].replace(",", "") or 0.0)
        except (KeyError, ValueError, IndexError):
            return 0.0
    stall_cols = [h for h in hdr if h.startswith("stall_") and "(Not" not in h]
    mix = collections.Counter()
    stalls = collections.Counter()
    by_op = {r: collections.Counter() for r in reasons}
    by_exec = {r: collections.Counter() for r in reasons}
    parked = total = 0.0
    for r in data:
        src = r[ix["Source"]].strip()
        op = _opcode(src)
        executed = num(r, EXECUTED)
        mix[op] += executed
        samples = num(r, SAMPLES)
        total += samples
        if executed <= parked_max_exec and samples > 0 and num(r, "stall_barrier") >= 0.9 * samples:
            parked += samples
            continue
        for c in stall_cols:
            stalls[c] += num(r, c)
        for reason in reasons:
            v = num(r, "stall_" + reason)
            by_op[reason][op] += v
            by_exec[reason][int(executed)] += v
    n = sum(mix.values())
    s = sum(stalls.values()) or 1.0
    out = [f"== {name[:110]}",
           f"   {int(n)} warp instructions executed, {len(data)} SASS lines; {int(total)} stall samples, of them "
           f"{int(parked)} ({100 * parked / max(total, 1):.1f}%) parked idle warps (left out below)",
           "   mix: " + ", ".join(f"{op} {100 * v / n:.1f}%" for op, v in mix.most_common(14)),
           "   stalls: " + ", ".join(f"{c[6:]} {100 * v / s:.1f}%" for c, v in stalls.most_common(10))]
    for reason in reasons:
        t = sum(by_op[reason].values()) or 1.0
        out.append(f"   {reason}: by opcode " + ", ".join(f"{k} {100 * v / t:.0f}%" for k, v in by_op[reason].most_common(top))
                   + "; by lines executed N times " + ", ".join(f"N={k}: {100 * v / t:.0f}%"
                                                                for k, v in by_exec[reason].most_common(5)))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--reasons", default="wait,selected,barrier,long_sb")
    args = ap.parse_args()
    for path in args.csv:
        print(summarise(path, [r for r in args.reasons.split(",") if r]))


if __name__ == "__main__":
    main()
