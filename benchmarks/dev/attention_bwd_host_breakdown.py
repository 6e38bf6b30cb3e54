"""Where an eager attention backward's host time goes (the eager lane), next to torch SDPA's (cuDNN).

With the GPU kept busy by a queued ``torch.cuda._sleep`` (so no launch waits for the device), per case:
``out.backward(g)`` in total, and inside it, by timers wrapped around the layers from the outside, the
lane's autograd node, the kernel-level backward, its Triton launches, its allocations and the sm_90 rule.
Then do_bench of forward / forward+backward and the same backward host time for cuDNN, and a cProfile of
the backward (top functions by own time). Medians of ``--reps`` calls.

Usage (GPU): ``python benchmarks/dev/attention_bwd_host_breakdown.py [--cases gpt2,bert] [--reps 60]``"""
from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import pykernels
from pykernels._kernels import _launch
import pykernels._kernels.attention as KA

PA = sys.modules["pykernels.attention"]
CASES = {"bert": (32, 12, 512, 64, False), "gpt2": (8, 12, 1024, 64, True), "s4096c": (4, 16, 4096, 128, True)}
_ACC: dict[str, float] = collections.defaultdict(float)
_N: dict[str, int] = collections.defaultdict(int)


def timed(name, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _ACC[name] += time.perf_counter() - t0
            _N[name] += 1
    return wrapper


def bwd_host(fwd, inputs, reps, g):
    """Median host time of out.backward(g), the GPU busy; with the timers' sums per call."""
    per = collections.defaultdict(list)
    for _ in range(reps):
        for t in inputs:
            t.grad = None
        out = fwd()
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)
        _ACC.clear()
        t0 = time.perf_counter()
        out.backward(g)
        per["out.backward(g)"].append(time.perf_counter() - t0)
        for k, v in _ACC.items():
            per[k].append(v)
    torch.cuda.synchronize()
    return {k: statistics.median(v) * 1e6 for k, v in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="gpt2,bert")
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for name in args.cases.split(","):
        b, h, s, d, causal = CASES[name]
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)

        def ours():
            return pykernels.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        for fn in (ours, cudnn):
            for _ in range(3):
                fn().backward(g)
        q.grad = k.grad = v.grad = None
        # wrap the layers (restored below)
        saved = (PA._LaneFunction.backward, PA._triton_bwd, KA.attention_bwd, _launch.FastKernel.call, None, None,
                 getattr(KA, "sm90_backward", None))
        PA._LaneFunction.backward = staticmethod(timed("lane node backward", saved[0]))
        PA._triton_bwd = timed("_triton_bwd", saved[1])
        KA.attention_bwd = timed("kernels attention_bwd", saved[2])
        _launch.FastKernel.call = timed("  triton launches", saved[3])
        if saved[6] is not None:
            KA.sm90_backward = timed("  sm90_backward rule", saved[6])
        ours_b = bwd_host(ours, (q, k, v), args.reps, g)
        PA._LaneFunction.backward = staticmethod(saved[0])
        PA._triton_bwd, KA.attention_bwd, _launch.FastKernel.call = saved[1], saved[2], saved[3]
        if saved[6] is not None:
            KA.sm90_backward = saved[6]
        cudnn_b = bwd_host(cudnn, (q, k, v), args.reps, g)
        row = {}
        for label, fn in (("ours", ours), ("cudnn", cudnn)):
            f_ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")

            def step(fn=fn):
                q.grad = k.grad = v.grad = None
                fn().backward(g)

            fb_ms = triton.testing.do_bench(step, warmup=10, rep=50, return_mode="median")
            gr = triton.testing.do_bench_cudagraph(step, rep=20)
            row[label] = (f_ms, fb_ms - f_ms, gr)
        print(f"== {name} B{b} H{h} S{s} D{d} causal={causal}")
        for label, (f_ms, b_ms, gr) in row.items():
            print(f"  {label:5s} do_bench fwd {f_ms * 1e3:.1f} us, bwd {b_ms * 1e3:.1f} us; graph fwd+bwd {gr * 1e3:.1f} us")
        print(f"  cudnn: out.backward(g) host {cudnn_b['out.backward(g)']:.1f} us (GPU busy)")
        for k_, v_ in ours_b.items():
            print(f"  ours: {k_:28s} {v_:8.1f} us")
        pr = cProfile.Profile()
        outs = []
        for _ in range(30):
            q.grad = k.grad = v.grad = None
            outs.append(ours())
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        pr.enable()
        for out in outs:
            out.backward(g)
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)
        del outs


if __name__ == "__main__":
    main()
