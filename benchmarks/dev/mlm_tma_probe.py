"""Tile configurations of the masked-LM loss's TMA logits kernel (``_logits_tma_kernel``) against the
pointer kernels and cuBLAS, at BERT-base MLM and GPT-2 LM sizes (bf16): forward (compaction given) and
sized backward, each checked against the pointer path's result before it is timed.

Usage (GPU): ``python benchmarks/dev/mlm_tma_probe.py [--cases bert,gpt2] [--budgets 16,32]``
Prints one line per variant: ms (triton.testing.do_bench median), logits TFLOP/s, max difference.
The cuBLAS lines time the plain (M, V) logits GEMM for reference; with V = 30522 or 50257 the output's
row stride is not a multiple of 16 bytes and cuBLAS runs far below its peak (95-230 TFLOP/s on an H200):
an alignment cliff the Triton kernels, which never store the logits, do not have."""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from pykernels._kernels import masked_lm_loss as kmod
from pykernels.masked_lm_loss import compact_rows

CASES = {"bert": (16384, 2446, 768, 30522), "gpt2": (8192, 8192, 768, 50257)}
CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
           (128, 128, 64, 4, 4), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4), (256, 128, 64, 8, 3)]


def _inputs(n, m, h, v):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).to(torch.bfloat16)
    target = torch.full((n,), -100, device="cuda")
    pos = torch.randperm(n, device="cuda", generator=g)[:m]
    target[pos] = torch.randint(0, v, (m,), device="cuda", generator=g)
    return hidden, weight, target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="bert,gpt2")
    ap.add_argument("--budgets", default="16,32,64", help="sized dlogits budgets in MiB (best dz config)")
    ap.add_argument("--host", action="store_true", help="host time and cProfile of the sized backward")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for case in args.cases.split(","):
        n, m, h, v = CASES[case]
        hidden, weight, target = _inputs(n, m, h, v)
        rows, count = compact_rows(target, -100)
        gflop = 2 * m * v * h / 1e9
        hc = hidden[rows[:m].long()].contiguous()
        ms = do_bench(lambda: torch.mm(hc, weight.t()))
        print(f"\n== {case}: N {n} M {m} H {h} V {v}; one logits GEMM {gflop:.1f} GFLOP")
        print(f"cuBLAS mm bf16 out: {ms:.3f} ms {gflop / ms:.0f} TFLOP/s")
        ms = do_bench(lambda: torch.mm(hc, weight.t(), out_dtype=torch.float32))
        print(f"cuBLAS mm fp32 out: {ms:.3f} ms {gflop / ms:.0f} TFLOP/s")

        def fwd():
            return kmod.masked_lm_loss_fwd(hidden, weight, target, None, rows, count, label_smoothing=0.0)

        ref_loss, ref_lse = _sweep("forward", "TMA_FWD_CONFIG", fwd, gflop,
                                   lambda out, ref: (out[0] - ref[0]).abs().max().item())
        g = torch.full((n,), 1.0 / m, device="cuda")

        def bwd():
            return kmod.masked_lm_loss_bwd_sized(g, hidden, weight, target, None, ref_lse, rows, count, m,
                                                 label_smoothing=0.0)

        _sweep("sized backward", "TMA_DZ_CONFIG", bwd, 3 * gflop,
               lambda out, ref: max((a.float() - b.float()).abs().max().item() / b.float().abs().max().item()
                                    for a, b in zip(out[:2], ref[:2])))
        saved = kmod.SIZED_DLOGITS_BUDGET_BYTES
        for mib in args.budgets.split(","):
            kmod.SIZED_DLOGITS_BUDGET_BYTES = int(mib) * 2**20
            ms = do_bench(bwd)
            print(f"sized backward TMA best, budget {mib} MiB: {ms:.3f} ms")
        kmod.SIZED_DLOGITS_BUDGET_BYTES = saved
        if args.host:
            _host_profile(fwd, bwd)



def _sweep(name: str, attr: str, fn, gflop: float, diff):
    """Time ``fn`` with the pointer kernels, then with the TMA kernel at each of CONFIGS (set through the
    module attribute ``attr``, left at the fastest); ``diff(out, ref)`` checks each against the pointer
    result first. Returns the pointer result."""
    kmod.USE_TMA = False
    ref = fn()
    ms = do_bench(fn)
    print(f"{name} pointer kernels: {ms:.3f} ms {gflop / ms:.0f} TFLOP/s")
    kmod.USE_TMA = True
    best = (1e9, None)
    for cfg in CONFIGS:
        setattr(kmod, attr, cfg)
        try:
            d = diff(fn(), ref)
            ms = do_bench(fn)
        except Exception as e:  # noqa: BLE001 (a config that does not fit: report, go on)
            print(f"{name} TMA {cfg}: {type(e).__name__} {str(e)[:120]}")
            continue
        best = min(best, (ms, cfg))
        print(f"{name} TMA {cfg}: {ms:.3f} ms {gflop / ms:.0f} TFLOP/s  max diff {d:.2e}")
    print(f"{name} best: {best}")
    if best[1] is not None:
        setattr(kmod, attr, best[1])
    return ref

def _host_profile(fwd, bwd) -> None:
    """Host time of one forward and one sized backward, each started on an idle GPU, and where the
    backward's host time goes (cProfile over 20 calls, by own time)."""
    import cProfile
    import pstats
    import time
    for name, fn in (("forward", fwd), ("sized backward", bwd)):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"host {name}: {1e3 * (t1 - t0):.3f} ms, then GPU drain {1e3 * (t2 - t1):.3f} ms")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        bwd()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
