"""Where the sm_90 attention kernels spend their time: one case's forward and backward through
``pykernels.scaled_dot_product_attention``, run a few times so that Nsight Compute (``ncu``) can pick one
launch of one kernel; and a forward length sweep (same tokens, growing S) of the Gluon forward next to
cuDNN, which separates the per-tile cost from the per-block cost.

Usage (GPU):
``python benchmarks/dev/attention_ncu.py --case bert`` (what ncu wraps: see ``--help`` for cases);
``python benchmarks/dev/attention_ncu.py --sweep [--d 64]``.
The ncu call this was written for (SASS lines with their stall samples, then the sections)::

    ncu --clock-control none -k regex:dkdv -s 2 -c 1 --section WarpStateStats --section SourceCounters \
        --section SpeedOfLight -o rep python3 benchmarks/dev/attention_ncu.py --case s4096c
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
"""
from __future__ import annotations

import argparse

import torch

import pykernels

CASES = {  # name -> (B, H, S, D, causal)
    "bert": (32, 12, 512, 64, False),
    "gpt2": (8, 12, 1024, 64, True),
    "s4096c": (4, 16, 4096, 128, True),
    "s8192": (2, 16, 8192, 128, False),
    "s8192c": (2, 16, 8192, 128, True),
}


def run_case(name: str, reps: int) -> None:
    b, h, s, d, causal = CASES[name]
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    for _ in range(reps):
        o = pykernels.scaled_dot_product_attention(q, k, v, is_causal=causal)
        o.backward(do)
    torch.cuda.synchronize()
    print(f"{name}: B{b} H{h} S{s} D{d} causal={causal}: {reps} forward+backward calls")


def sweep(d: int) -> None:
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    tokens = 16384
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
          f"forward, H12 D{d}, {tokens} tokens, do_bench")
    for s in (256, 512, 1024, 2048, 4096, 8192):
        b = tokens // s
        for causal in (False, True):
            q, k, v = (torch.randn(b, 12, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * b * 12 * s * s * d * (0.5 if causal else 1.0)
            ours = triton.testing.do_bench(
                lambda: pykernels.scaled_dot_product_attention(q, k, v, is_causal=causal), warmup=20, rep=100)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cud = triton.testing.do_bench(
                    lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
                    warmup=20, rep=100)
            print(f"S{s:5d} B{b:3d} {'causal' if causal else 'full  '}: pykernels {flops / ours * 1e-9:6.1f} "
                  f"cuDNN {flops / cud * 1e-9:6.1f} TFLOP/s (ratio {cud / ours:.3f})")


def _graph_ms(fn, reps: int = 20) -> float:
    """Median over 5 replays of a CUDA graph holding ``reps`` calls of ``fn``, per call (ms)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times)[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=sorted(CASES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--d", type=int, default=64)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile")
        return
    if args.sweep:
        sweep(args.d)
    if args.case:
        run_case(args.case, args.reps)


if __name__ == "__main__":
    main()
