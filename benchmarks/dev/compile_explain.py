"""What torch.compile makes of a training step's forward + loss (``benchmarks/train_step.py``'s variants): dynamo's
graphs, graph breaks and their reasons (``torch._dynamo.explain``), and the ops of the pykernels namespaces the
graphs hold (C++ pairs ``pykernels_cuda::*`` or Triton custom ops ``pykernels::*``).

Usage (GPU): ``python benchmarks/dev/compile_explain.py [--models bert gpt2] [--variants pykernels "hf sdpa"]``;
``--smoke``: tiny configs on CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_step as ts  # noqa: E402


def explain(case, variant: str, state: dict, batch, device) -> None:
    model, fwd = ts.build(case, variant, state, device)
    inputs, labels, mask = (*batch, None)[:3]
    with torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext():
        out = torch._dynamo.explain(fwd)(inputs, labels, mask)
    ops = Counter()
    for g in out.graphs:
        for node in g.graph.nodes:
            if node.op == "call_function" and "pykernels" in str(node.target):
                ops[str(node.target)] += 1
    print(f"== {case.name} / {variant}: {out.graph_count} graphs, {out.graph_break_count} breaks, "
          f"{out.op_count} ops")
    for reason in out.break_reasons[:10]:
        print("  break:", str(reason.reason)[:300])
        for frame in reason.user_stack[-3:]:
            print("     at", f"{frame.filename}:{frame.lineno}", frame.name)
    for op, n in ops.most_common():
        print(f"  {n:4d} x {op}")
    torch._dynamo.reset()
    del model, fwd


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["bert", "gpt2"])
    ap.add_argument("--variants", nargs="+", default=["pykernels"])
    ap.add_argument("--smoke", action="store_true", help="train_step's tiny configs on CPU (the reference backend)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    for case in ts.cases(args.smoke):
        if case.name not in args.models:
            continue
        state, batch = ts.case_inputs(case, device)
        for variant in args.variants:
            explain(case, variant, state, batch, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
