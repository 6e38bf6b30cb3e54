"""Where the masked-LM loss spends its GPU time, and what its small kernels cost.

1. Kernel table (torch.profiler) of one public forward+backward per case: every kernel's time and count.
2. The cuBLAS GEMMs of one BERT-base chunk alone (CUDA events, 20 reps): dW = dz^T h and dh += dz W in the
   layouts the backward uses, and their transposed forms, in TFLOP/s.
3. The compaction kernel and the forward's combine kernel under their configs (``COMPACT_CONFIG``,
   ``COMBINE_BLOCKS`` / ``COMBINE_WARPS``): each kernel's device time (torch.profiler), median of 10 calls.

run156 also timed the sized backward's dW GEMM (and dbias sums) on a second stream beside the dh GEMM, in
device wall time (a queued sleep, then the calls): BERT-base 1.000-1.003x, BERT-large 1.008-1.019x, GPT-2
1.013-1.016x, bitwise equal gradients; GPT-2's CUDA-graph replay in run158 moved 0.2%. Not kept (HISTORY.md).

Usage (GPU): ``python benchmarks/dev/mlm_kernel_probe.py [--cases bert,bert_large,gpt2] [--parts table,gemm,small]``"""
from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import pykernels
from pykernels._kernels import masked_lm_loss as kmod

CASES = {"bert": (16384, 2446, 768, 30522), "bert_large": (16384, 2377, 1024, 30522), "gpt2": (8192, 8192, 768, 50257)}


def make(n, m, h, v, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).to(torch.bfloat16).requires_grad_(True)
    target = torch.full((n,), -100, device="cuda")
    pos = torch.randperm(n, device="cuda", generator=g)[:m]
    target[pos] = torch.randint(0, v, (m,), device="cuda", generator=g)
    return hidden, weight, target


def cuda_events(fn, calls=5, warmup=3, sync_each=False):
    """The CUDA kernel events (torch.profiler) of ``calls`` calls of ``fn`` after ``warmup``, back to back or
    (``sync_each``) one at a time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            if sync_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_rows(events, calls=5):
    """{kernel name: [device us per call, launches]} of ``cuda_events``' events."""
    rows = {}
    for e in events:
        r = rows.setdefault(e.name, [0.0, 0])
        r[0] += e.device_time_total / calls
        r[1] += 1
    return rows


def kernel_table(name, hidden, weight, target, dense):
    def step():
        hidden.grad = weight.grad = None
        pykernels.masked_lm_loss(hidden, weight, target, dense=dense).backward()
    rows = kernel_rows(cuda_events(step))
    total = sum(r[0] for r in rows.values())
    print(f"\n== {name}: kernel time per forward+backward {total:.1f} us")
    for k, (t, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {t:8.1f} us  x{c // 5:<3d} {k[:110]}")


def ev_time(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


def gemm_probe(m=2446, vc=7680, h=768):
    d = torch.randn(m, vc, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(vc, h, device="cuda", dtype=torch.bfloat16)
    hc = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(m, h, device="cuda")
    acc_t = torch.zeros(h, m, device="cuda")
    dw = torch.empty(vc, h, device="cuda", dtype=torch.bfloat16)
    dw_t = torch.empty(h, vc, device="cuda", dtype=torch.bfloat16)
    flop = 2 * m * vc * h
    print(f"\n== one chunk's GEMMs alone: M {m}, chunk {vc}, H {h} ({flop / 1e9:.1f} GFLOP each)")
    cases = {
        "dW = dz^T h (as used)": lambda: torch.mm(d.t(), hc, out=dw),
        "dW^T = h^T dz": lambda: torch.mm(hc.t(), d, out=dw_t),
        "dh += dz W (as used, fp32 out)": lambda: torch.addmm(acc, d, w, out_dtype=torch.float32, out=acc),
        "dh^T += W^T dz^T (fp32 out)": lambda: torch.addmm(acc_t, w.t(), d.t(), out_dtype=torch.float32, out=acc_t),
        "dh = dz W (bf16 out)": lambda: torch.mm(d, w),
    }
    for k, fn in cases.items():
        us = ev_time(fn)
        print(f"  {k:34s} {us:7.1f} us  {flop / us / 1e6:6.1f} TFLOP/s")


def kernel_us(fn, pattern, calls=10):
    """Median device time of the kernels whose name contains ``pattern``, one call at a time (torch.profiler)."""
    ts = [e.device_time_total for e in cuda_events(fn, calls, warmup=1, sync_each=True) if pattern in e.name]
    return statistics.median(ts) if ts else float("nan")


def small_kernels(name, n, m, h, v):
    hidden, weight, target = make(n, m, h, v)
    hd, wd = hidden.detach(), weight.detach()
    print(f"\n== {name}: small kernels (device time a launch)")
    default = kmod.COMPACT_CONFIG
    for cfg in [(1024, 8192, 8), (1024, 4096, 8), (2048, 8192, 8), (512, 8192, 8), (1024, 16384, 16),
                (1024, 8192, 4)]:
        kmod.COMPACT_CONFIG = cfg
        ref = kmod.compact(target, -100)
        ok = int(ref[1].item()) == m
        us = kernel_us(lambda: kmod.compact(target, -100), "_compact_kernel")
        print(f"  compact {str(cfg):18s} {us:6.1f} us {'ok' if ok else 'WRONG COUNT'}")
    kmod.COMPACT_CONFIG = default
    rows, count = kmod.compact(target, -100)[:2]
    db, dw = kmod.COMBINE_BLOCKS, kmod.COMBINE_WARPS
    base = None
    for blocks, warps in [((32, 64), 4), ((32, 32), 4), ((16, 64), 4), ((64, 32), 4), ((32, 128), 8), ((16, 32), 2)]:
        kmod.COMBINE_BLOCKS, kmod.COMBINE_WARPS = blocks, warps
        loss, lse = kmod.masked_lm_loss_fwd(hd, wd, target, None, rows, count, label_smoothing=0.0)
        if base is None:
            base = loss.clone()
        same = torch.allclose(loss, base, rtol=1e-6, atol=0)
        us = kernel_us(lambda: kmod.masked_lm_loss_fwd(hd, wd, target, None, rows, count, label_smoothing=0.0),
                       "combine")
        print(f"  combine {str(blocks):10s} {warps} warps {us:7.1f} us {'ok' if same else 'MISMATCH'}")
    kmod.COMBINE_BLOCKS, kmod.COMBINE_WARPS = db, dw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="bert,bert_large,gpt2")
    ap.add_argument("--parts", default="table,gemm,small")
    args = ap.parse_args()
    parts = args.parts.split(",")
    print(torch.cuda.get_device_name(), torch.__version__)
    for name in args.cases.split(",") if "table" in parts else []:
        n, m, h, v = CASES[name]
        kernel_table(name, *make(n, m, h, v), dense=name == "gpt2")
    if "gemm" in parts:
        gemm_probe()
    for name in args.cases.split(",") if "small" in parts else []:
        small_kernels(name, *CASES[name])



if __name__ == "__main__":
    main()
