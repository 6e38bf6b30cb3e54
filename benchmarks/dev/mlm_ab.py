"""One line per case of the masked-LM loss as installed: forward+backward with do_bench (host included, as
ANCHORS times the peers), its GPU time (the kernels' device time, torch.profiler), the peak memory above the
inputs, and the host time of the forward and of the backward with the GPU kept busy (a queued sleep: only
the host's own work). Run it once per tree being compared, alternating, in one call on one machine.

Usage (GPU): ``python benchmarks/dev/mlm_ab.py --label new [--cases bert,large,gpt2] [--bias] [--max-valid 0.2]``"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import pykernels  # noqa: E402

CASES = {"bert": (16384, 2446, 768, 30522, True), "large": (16384, 2377, 1024, 30522, True),
         "gpt2": (8192, 8192, 768, 50257, False)}


def host_times(fwd, h, w, reps=30):
    tf, tb = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(30_000_000)
        t0 = time.perf_counter()
        loss = fwd()
        t1 = time.perf_counter()
        torch.cuda.synchronize()  # the forward's count copy done: the backward's one wait returns at once
        torch.cuda._sleep(60_000_000)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        h.grad = w.grad = None
        tf.append(t1 - t0)
        tb.append(t3 - t2)
    torch.cuda.synchronize()
    return statistics.median(tf) * 1e6, statistics.median(tb) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="")
    ap.add_argument("--cases", default="bert,large,gpt2")
    ap.add_argument("--bias", action="store_true", help="with a decoder bias (BERT's MLM head has one)")
    ap.add_argument("--max-valid", type=float, default=0.0,
                    help="MLM cases: max_valid = this fraction of the tokens (the CUDA-graph path; graph replay timed)")
    args = ap.parse_args()
    print(f"# {args.label}: {pykernels.__file__} {torch.cuda.get_device_name()} torch {torch.__version__} "
          f"triton {triton.__version__}")
    for name in args.cases.split(","):
        n, m, hd, v, masked = CASES[name]
        torch.manual_seed(0)
        hidden = torch.randn(n, hd, device="cuda", dtype=torch.bfloat16)
        weight = (torch.randn(v, hd, device="cuda") * hd**-0.5).to(torch.bfloat16)
        bias = torch.randn(v, device="cuda", dtype=torch.bfloat16).requires_grad_() if args.bias else None
        target = torch.full((n,), -100, device="cuda")
        target[torch.randperm(n, device="cuda")[:m]] = torch.randint(0, v, (m,), device="cuda")
        h = hidden.requires_grad_(True)
        w = weight.requires_grad_(True)
        kw = {} if masked else {"dense": True}
        if masked and args.max_valid > 0:
            kw = {"max_valid": int(args.max_valid * n)}

        def fwd():
            return pykernels.masked_lm_loss(h, w, target, bias=bias, **kw)

        def step():
            h.grad = w.grad = None
            fwd().backward()

        for _ in range(3):
            step()
        f_ms, b_ms = common.bench_fwd_bwd(fwd, inputs=(h, w), warmup=10, rep=60)
        h.grad = w.grad = None
        peak = common.peak_extra_mib(step)
        gpu = common.gpu_kernel_ms(step, reps=5)
        graph = (float(triton.testing.do_bench_cudagraph(step, rep=20)) if not masked or "max_valid" in kw
                 else float("nan"))
        hf, hb = host_times(fwd, h, w)
        print(f"{args.label:5s} {name:6s} do_bench fwd {f_ms:.3f} bwd {b_ms:.3f} total {f_ms + b_ms:.3f} ms | "
              f"GPU {gpu:.3f} ms | graph {graph:.3f} | peak {peak:.1f} MiB | host fwd {hf:.0f} us bwd {hb:.0f} us",
              flush=True)


if __name__ == "__main__":
    main()
