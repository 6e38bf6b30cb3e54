"""The captured MLM loss's bounded backward (``kernels/masked_lm_loss.masked_lm_loss_bwd_bounded``): what its
graph-safe overflow pass costs when no row is past the bound, and the memory of a captured call.

For BERT-base MLM (16384 tokens, 2446 masked, H 768, V 30522, bf16) after an eager warm-up, a forward+backward
replayed from a CUDA graph (``do_bench_cudagraph``) for: the default call (the bounded backward, its overflow pass in
row blocks captured in IF nodes), the same with IF nodes off (every block launched, its programs exiting), the
bounded backward at a capacity 192-255 rows below the valid count (the overflow pass's rows run at replay),
``max_valid`` at the bounded call's capacity (the capacity pass alone: the difference is the overflow pass) and at
N / 5, and ``graph_safe=True``. Memory: the peak above the inputs of one
forward+backward on the path a capture takes, its gradients included (capture simulated:
``pykernels.masked_lm_loss.capturing`` answers True; the graph's pool holds at least that much). run391-393's peaks
were taken with the previous step's gradients (69 MiB, freed by the step) in the base: 69 MiB low.

``--profile``: also each kernel's device time (torch.profiler) in one call of the capacity pass alone and of the
bounded backward with rows past its capacity, both on the captured path run eagerly (every overflow block launched):
where the overflow rows' time goes.

Usage (GPU): ``python benchmarks/dev/mlm_bounded_probe.py [--profile]`` -> stdout and
``$OUT/mlm_bounded_probe.txt``.
"""
from __future__ import annotations

import importlib
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
    import triton.testing
    kmod = importlib.import_module("pykernels._kernels.masked_lm_loss")
    mll = importlib.import_module("pykernels.masked_lm_loss")
    case = bench.CASES[0]
    hidden, weight, target = bench.make_inputs(case, torch.device("cuda"), torch.bfloat16)
    h = hidden.requires_grad_(True)
    w = weight.requires_grad_(True)
    n = case.n

    def call(**kw):
        def step():
            h.grad = w.grad = None
            pykernels.masked_lm_loss(h, w, target, backend="triton", **kw).backward()
        return step

    call()()  # eager warm-up: the sized backward notes the valid count (the bounded call's capacity)
    torch.cuda.synchronize()
    bound = mll._VALID_SEEN.bound(h.device, n)
    env = common.env_record()
    lines = [", ".join(f"{k} {v}" for k, v in env.items()),
             f"BERT-base MLM {n} x {case.h}, V {case.v}, {case.m} valid; bounded capacity {bound} rows"]
    tuning = importlib.import_module("pykernels._kernels._tuning")
    m = int((target != -100).sum())
    short = (m - 192) // kmod.OVERFLOW_ALIGN * kmod.OVERFLOW_ALIGN  # a capacity below the count: overflow rows run
    rows = []
    for label, kw, no_if, cap in (
            ("default (bounded, overflow blocks in IF nodes)", {}, False, bound),
            ("default (bounded), IF nodes off: every block launched", {}, True, bound),
            (f"bounded at capacity {short}: {m - short} rows past it", {}, False, short),
            (f"max_valid={bound} (the capacity pass alone)", {"max_valid": bound}, False, bound),
            (f"max_valid={n // 5} (N / 5)", {"max_valid": n // 5}, False, bound),
            ("graph_safe=True", {"graph_safe": True}, False, bound)):
        real_bound, real_capturing = mll._VALID_SEEN.bound, mll.capturing
        mll._VALID_SEEN.bound = lambda dev, n, _cap=cap: _cap
        real_support = tuning.graph_if_support
        if no_if:
            tuning.graph_if_support = lambda: (None, "probe: IF nodes off")
        try:
            step = call(**kw)
            step()
            ms = float(triton.testing.do_bench_cudagraph(step, rep=30))
            mll.capturing = lambda device=None: True  # the captured path, run eagerly for its peak
            h.grad = w.grad = None  # (run391-393 measured with the last step's gradients, 69 MiB, in the base)
            peak = common.peak_extra_mib(step)
        finally:
            mll._VALID_SEEN.bound, mll.capturing = real_bound, real_capturing
            tuning.graph_if_support = real_support
        rows.append(f"{label:56s} replay {ms:7.3f} ms   peak extra (captured path) {peak:6.1f} MiB")
        print(rows[-1], flush=True)
    if "--profile" in sys.argv[1:]:
        for label, kw, cap in ((f"max_valid={bound}", {"max_valid": bound}, bound),
                               (f"bounded at capacity {short} ({m - short} rows past it)", {}, short)):
            real_bound, real_capturing = mll._VALID_SEEN.bound, mll.capturing
            mll._VALID_SEEN.bound = lambda dev, n, _cap=cap: _cap
            mll.capturing = lambda device=None: True
            try:
                step = call(**kw)
                step()
                table = sorted(common._device_us(step).items(), key=lambda kv: -kv[1])
            finally:
                mll._VALID_SEEN.bound, mll.capturing = real_bound, real_capturing
            rows.append(f"kernels of one call, {label}: {sum(us for _, us in table):.1f} us")
            rows += [f"  {us:9.1f} us  {name[:110]}" for name, us in table]
            print("\n".join(rows[-len(table) - 1:]), flush=True)
    lines.append(f"IF nodes: {tuning.graph_if_support()[1] or 'yes'}; overflow blocks of "
                 f"{[r for _, r in kmod.overflow_blocks(n, bound)]} rows")
    text = "\n".join(lines + rows) + "\n"
    out = os.environ.get("OUT")
    if out:
        Path(out, "mlm_bounded_probe.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
