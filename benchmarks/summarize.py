"""Markdown tables for the README from benchmark CSVs.

    python benchmarks/summarize.py benchmarks/results/attention_NVIDIA_H200_2026-11-26_run2.csv ...

Each op's CSV has its own columns; this picks the ones a reader compares (time or rate, the ratio
to peers, the validation status) where present, and prints one table per file with the card,
versions and date it was measured with.
"""
from __future__ import annotations

import csv
import sys

COLUMNS = {
    "attention": ["case", "impl", "status", "fwd_TFLOPs", "bwd_TFLOPs", "fwd_TFLOPs_graph", "bwd_TFLOPs_graph",
                  "fwd_vs_best_peer", "bwd_vs_best_peer", "peak_extra_MiB", "time_vs_cudnn_padded"],
    "layer_norm": ["variant", "M", "N", "impl", "status", "fwd_us", "fwd_pct_copy", "fwdbwd_us", "fwd_us_graph",
                   "fwd_pct_copy_graph", "fwdbwd_us_graph", "fb_speedup_vs_eager", "fb_graph_speedup_vs_eager"],
    "cross_entropy": ["case", "N", "V", "impl", "status", "fwd_ms", "fwd_bwd_ms", "fwd_pct_copy", "fwd_bwd_pct_copy",
                      "fwd_ms_graph", "fwd_bwd_ms_graph", "fwd_pct_copy_graph", "fwd_bwd_pct_copy_graph", "peak_extra_MiB"],
    "masked_lm_loss": ["case", "impl", "M", "status", "fwd_ms", "bwd_ms", "total_ms", "total_ms_graph", "floor_ms",
                       "peak_extra_MiB", "dh_rel_err"],
}


def table(path: str) -> str:
    rows = [r for r in csv.DictReader(open(path)) if r.get("impl") != "card"]
    if not rows:
        return f"(no rows in {path})"
    op = next((k for k in COLUMNS if path.split("/")[-1].startswith(k)), None)
    cols = [c for c in (COLUMNS.get(op) or list(rows[0])) if any(r.get(c) for r in rows)]
    r0 = rows[0]
    head = (f"{r0.get('gpu', '?')}, torch {r0.get('torch', '?')}, triton {r0.get('triton', '?')}, "
            f"{r0.get('date', '?')}, commit {r0.get('commit', '?')[:12]} ({path.split('/')[-1]})")
    out = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join((r.get(c) or "") for c in cols) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
