"""The LM-head loss's kernels one by one: each launch of one forward+backward in issue order with its device time,
and the sums by kernel, for the GPT-2 causal LM (8192 tokens, every label valid, V 50257) and BERT-base MLM: what
the time past the 4-GEMM floor is made of (HISTORY.md, sixty-fifth session).

Usage (GPU): ``python benchmarks/dev/mlm_chunk_timeline.py`` -> stdout and ``$OUT/mlm_chunk_timeline.txt``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
import masked_lm_loss as bench  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 0
    import pykernels
    env = common.env_record()
    lines = [", ".join(f"{k} {v}" for k, v in env.items())]
    for case in (bench.CASES[2], bench.CASES[0]):
        hidden, weight, target = bench.make_inputs(case, torch.device("cuda"), torch.bfloat16)
        h = hidden.requires_grad_(True)
        w = weight.requires_grad_(True)

        def step():
            h.grad = w.grad = None
            pykernels.masked_lm_loss(h, w, target, backend="triton").backward()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        m = int((target != -100).sum())
        lines.append(f"\n== {case.name}: N {case.n}, H {case.h}, V {case.v}, {m} valid")
        flops = 8 * m * case.v * case.h
        events = sorted(common._device_events(step), key=lambda e: e.time_range.start)
        t0 = events[0].time_range.start
        total = sum(e.device_time_total for e in events)
        span = events[-1].time_range.end - t0
        lines.append(f"kernels {total:.1f} us, first start to last end {span:.1f} us; 4 GEMMs of {m} x {case.v} x "
                     f"{case.h}: {flops / 1e9:.0f} GFLOP, {flops / total / 1e6:.0f} TFLOP/s over the kernels' time")
        by = {}
        for e in events:
            by.setdefault(e.name, [0, 0.0])
            by[e.name][0] += 1
            by[e.name][1] += e.device_time_total
        for name, (k, us) in sorted(by.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {us:9.1f} us  {k:3d} x  {name[:100]}")
        lines.append("in issue order (start offset, duration, name):")
        for e in events:
            lines.append(f"  {e.time_range.start - t0:9.1f} {e.device_time_total:8.1f}  {e.name[:90]}")
        print("\n".join(lines[-len(events) - len(by) - 4:-len(events) - 1]), flush=True)
    text = "\n".join(lines) + "\n"
    out = os.environ.get("OUT")
    if out:
        Path(out, "mlm_chunk_timeline.txt").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
