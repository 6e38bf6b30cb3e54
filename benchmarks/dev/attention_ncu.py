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


def ab_dkdv() -> None:
    """The sm_90 dK/dV kernel with ``STATS_EARLY`` off / on (the consumers read a block's lse / delta from
    shared memory after / before issuing its first GEMMs; run73 compared global-memory lse / delta
    with shared memory the same way, before that path was removed):
    gradients compared bitwise, kernel time by graph replay, alternating twice (same run, same card)."""
    import triton
    from attention_sm90_gluon_ws import graph_ms

    from pykernels._kernels import attention_sm90 as k90
    from pykernels._kernels import attention_sm90_bwd as kb
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}: dK/dV kernel, "
          f"STATS_EARLY off / on, graph replay, best of two rounds; TFLOP/s of its 4 GEMMs")
    for name, (b, h, s, d, causal) in CASES.items():
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        scale = d ** -0.5
        o, lse = k90.attention_fwd_sm90(q, k, v, causal=causal, scale=scale)
        delta = (do.float() * o.float()).sum(-1)
        flops = 4 * 2 * b * h * s * s * d * (0.5 if causal else 1.0)
        res, best = {}, {}
        for _ in range(2):
            for on in (False, True):
                kb.STATS_EARLY = on
                dk, dv = torch.empty_like(k), torch.empty_like(v)
                fn = (lambda: kb.attention_bwd_dkdv_sm90(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=scale))
                assert fn()
                res[on] = (dk.clone(), dv.clone())
                best[on] = min(best.get(on, 1e9), graph_ms(fn))
        same = all(torch.equal(a, b_) for a, b_ in zip(res[False], res[True]))
        print(f"{name:8s} B{b} H{h} S{s} D{d} {'causal' if causal else 'full'}: off {best[False] * 1e3:8.1f} us "
              f"({flops / best[False] * 1e-9:5.1f}), on {best[True] * 1e3:8.1f} us ({flops / best[True] * 1e-9:5.1f}); "
              f"speed-up {best[False] / best[True]:.3f}; bitwise equal: {same}")
    kb.STATS_EARLY = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=sorted(CASES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--ab-dkdv", action="store_true", help="the dK/dV kernel with and without STATS_EARLY")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile")
        return
    if args.ab_dkdv:
        ab_dkdv()
    if args.sweep:
        sweep(args.d)
    if args.case:
        run_case(args.case, args.reps)


if __name__ == "__main__":
    main()
