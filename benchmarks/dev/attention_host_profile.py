"""Where an eager ``pykernels.scaled_dot_product_attention`` call spends its host time, next to torch's SDPA
(cuDNN): per shape, the call's host time (device drained first), do_bench time, graph-replay time, and
for pykernels torch.profiler's op table (CPU ops and the kernels each call launches) and cProfile's top
Python functions. A do_bench time far above both the host time and the kernel time points at a wait.

Usage (GPU): ``python benchmarks/dev/attention_host_profile.py [--grad]``."""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import pykernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_ncu import CASES as NCU_CASES  # noqa: E402
from attention_sm90_gluon_ws import graph_ms  # noqa: E402

# the Nsight probe's shapes, plus BERT-base with a key-padding mask (the attention benchmark's case)
CASES = {"bert": NCU_CASES["bert"], "bert_keypad": NCU_CASES["bert"], "gpt2": NCU_CASES["gpt2"],
         "s4096c": NCU_CASES["s4096c"]}


def host_us(fn, n: int = 50) -> float:
    """Median host time of one call, the device drained before each."""
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[n // 2] * 1e6


def main() -> None:
    import triton
    ap = argparse.ArgumentParser()
    ap.add_argument("--grad", action="store_true", help="forward + backward instead of the forward")
    ap.add_argument("--profile", default="gpt2", help="case to profile, or none")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
          f"{'forward+backward' if args.grad else 'forward'}")
    for name, (b, h, s, d, causal) in CASES.items():
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=args.grad)
                   for _ in range(3))
        do = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        mask = None
        if name.endswith("keypad"):  # (B, 1, 1, S) bool, lengths uniform in [S/2, S] (the benchmark's case)
            lens = torch.randint(s // 2, s + 1, (b,), device="cuda")
            mask = (torch.arange(s, device="cuda")[None, :] < lens[:, None])[:, None, None, :]

        def ours():
            o = pykernels.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            if args.grad:
                o.backward(do)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            if args.grad:
                o.backward(do)

        for label, fn in (("pykernels", ours), ("cuDNN", cudnn)):
            for _ in range(5):
                fn()
            hu = host_us(fn)
            db = triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3
            gr = graph_ms(fn) * 1e3 if not args.grad else float("nan")
            print(f"{name:7s} {label:9s}: host {hu:7.1f} us, do_bench {db:7.1f} us, graph replay {gr:7.1f} us")
        if name == args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    ours()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                ours()
            torch.cuda.synchronize()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
