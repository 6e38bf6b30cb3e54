"""Where the masked-LM loss spends its GPU time: torch.profiler kernel table of one forward+backward
(BERT-base MLM shape by default), for the sized and the graph-safe backward, plus a check that cuBLAS
takes ``out_dtype=torch.float32`` for bf16 inputs on this build.

Usage (GPU): ``python benchmarks/dev/mlm_profile.py [--n 16384 --h 768 --v 30522 --m 2446]``"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import pykernels
from pykernels._kernels import masked_lm_loss as kmod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--h", type=int, default=768)
    ap.add_argument("--v", type=int, default=30522)
    ap.add_argument("--m", type=int, default=2446)
    ap.add_argument("--budgets", default="16,64", help="sized dlogits budgets in MiB")
    args = ap.parse_args()
    t = torch.ones(2, 2, dtype=torch.bfloat16, device="cuda")
    try:
        print("mm out_dtype fp32:", torch.mm(t, t, out_dtype=torch.float32).dtype)
        acc = torch.zeros(2, 2, device="cuda")
        print("addmm out_dtype fp32:", torch.addmm(acc, t, t, out_dtype=torch.float32).dtype)
    except Exception as e:  # noqa: BLE001
        print("out_dtype unavailable:", type(e).__name__, e)
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(args.n, args.h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    weight = (torch.randn(args.v, args.h, device="cuda", generator=g) * args.h**-0.5).to(torch.bfloat16)
    weight.requires_grad_(True)
    target = torch.full((args.n,), -100, device="cuda")
    pos = torch.randperm(args.n, device="cuda", generator=g)[:args.m]
    target[pos] = torch.randint(0, args.v, (args.m,), device="cuda", generator=g)
    variants = [(f"sized {b} MiB", False, int(b)) for b in args.budgets.split(",")] + [("graph-safe", True, None)]
    for name, gs, budget in variants:
        saved = kmod.SIZED_DLOGITS_BUDGET_BYTES
        if budget:
            kmod.SIZED_DLOGITS_BUDGET_BYTES = budget * 2**20
        for _ in range(3):
            pykernels.masked_lm_loss(hidden, weight, target, graph_safe=gs).backward()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            pykernels.masked_lm_loss(hidden, weight, target, graph_safe=gs).backward()
        end.record()
        torch.cuda.synchronize()
        print(f"\n== {name}: {start.elapsed_time(end) / 10:.3f} ms per forward+backward (events, eager)")
        # host time of one call with the GPU idle at the start (what the host spends launching it)
        import time
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = pykernels.masked_lm_loss(hidden, weight, target, graph_safe=gs)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        print(f"host: forward {1e3 * (t1 - t0):.3f} ms, backward {1e3 * (t2 - t1):.3f} ms, "
              f"then GPU drain {1e3 * (t3 - t2):.3f} ms")
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            pykernels.masked_lm_loss(hidden, weight, target, graph_safe=gs).backward()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
        kmod.SIZED_DLOGITS_BUDGET_BYTES = saved


if __name__ == "__main__":
    main()
