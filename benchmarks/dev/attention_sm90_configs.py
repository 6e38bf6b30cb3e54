"""Probe: the sm_90 Gluon attention kernels' tile configs against their defaults, in CUDA-graph replay (GPU
time; the D = 64 shapes are host-bound under do_bench), on the benchmark's shapes: the forward
(``attention_sm90.CONFIGS``) at D = 64 and 128, and the backward's dK/dV (``attention_sm90_bwd.DKDV_CONFIGS``)
and dQ (``DQ_CONFIGS``) kernels at D = 128. Each line: config, ms, TFLOP/s (the kernel's own GEMM count),
and the max difference from the default config's output (configs change only the summation order).

``--d256``: instead the forward at D = 256 (its configs, each with its ``q_bufs``) next to the Triton forward
(``PYKERNELS_ATTN_SM90=0``; its autotuned D = 256 tier), with each one's max difference from Triton's output.

Usage (GPU): ``python benchmarks/dev/attention_sm90_configs.py [--d256]``.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_sm90_gluon_ws import graph_ms  # noqa: E402

from pykernels._kernels import attention_sm90 as kf  # noqa: E402
from pykernels._kernels import attention_sm90_bwd as kb  # noqa: E402

FWD = {64: [(64, 128, 2), (64, 128, 3), (64, 64, 2), (64, 64, 4)], 128: [(64, 128, 2), (64, 64, 3), (64, 64, 4)],
       256: [(64, 64, 2), (64, 32, 3), (64, 32, 4), (64, 128, 1)]}
D256_SHAPES = [(4, 8, 4096, 256, True), (4, 8, 2048, 256, False), (2, 8, 8192, 256, False), (16, 16, 512, 256, False),
               (1, 8, 8192, 256, True)]
DKDV = [(64, 64, 2), (64, 64, 3)]
DQ = [(64, 64, 4), (64, 64, 5), (64, 64, 3)]


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    d256 = "--d256" in sys.argv
    shapes = D256_SHAPES if d256 else [(32, 12, 512, 64, False), (8, 12, 1024, 64, True), (4, 16, 4096, 128, True),
                                       (2, 16, 8192, 128, False), (2, 16, 8192, 128, True)]
    for b, h, s_, d, causal in shapes:
        q, k, v, do = (torch.randn(b, h, s_, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        sc = d ** -0.5
        gemm = 2 * b * h * s_ * s_ * d / (2 if causal else 1)
        name = f"B{b} H{h} S{s_} D{d} {'causal' if causal else 'full'}"
        ref = None
        if d256:  # the Triton forward (the sm_90 kernel off for these calls), autotuned first
            from pykernels._kernels import attention as katt
            os.environ["PYKERNELS_ATTN_SM90"] = "0"
            tri = lambda: katt.attention_fwd(q, k, v, None, causal=causal, scale=sc, dropout_p=0.0, seed=0)  # noqa: E731
            ref = tri()
            ms = graph_ms(tri)
            os.environ["PYKERNELS_ATTN_SM90"] = "1"
            print(f"{name} fwd triton: {ms:.4f} ms {2 * gemm / ms / 1e9:.0f} TFLOP/s", flush=True)
        for cfg in FWD[d]:
            try:
                o, lse = kf.attention_fwd_sm90(q, k, v, causal=causal, scale=sc, config=cfg)
                ref = (o, lse) if ref is None else ref
                err = (o.float() - ref[0].float()).abs().max().item()
                lerr = (lse - ref[1]).abs().max().item()
                ms = graph_ms(lambda cfg=cfg: kf.attention_fwd_sm90(q, k, v, causal=causal, scale=sc, config=cfg))
                qb = kf.q_bufs(*cfg, d)
                print(f"{name} fwd {cfg} q_bufs {qb}: {ms:.4f} ms {2 * gemm / ms / 1e9:.0f} TFLOP/s; max |o - "
                      f"{'triton' if d256 else 'default'}| {err:.1e}, lse {lerr:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001  (a probe: report and go on)
                print(f"{name} fwd {cfg}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
        if d != 128 or d256:
            continue
        o, lse = ref
        delta = (o.float() * do.float()).sum(-1).contiguous()
        dk, dv, dq = torch.empty_like(k), torch.empty_like(v), torch.empty_like(q)
        for cfg in DKDV:
            try:
                ms = graph_ms(lambda cfg=cfg: kb.attention_bwd_dkdv_sm90(do, q, k, v, lse, delta, dk, dv, causal=causal,
                                                                          scale=sc, config=cfg))
                print(f"{name} dK/dV {cfg}: {ms:.4f} ms {4 * gemm / ms / 1e9:.0f} TFLOP/s", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name} dK/dV {cfg}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
        for cfg in DQ:
            try:
                ms = graph_ms(lambda cfg=cfg: kb.attention_bwd_dq_sm90(do, q, k, v, lse, delta, dq, causal=causal,
                                                                        scale=sc, config=cfg))
                print(f"{name} dQ {cfg}: {ms:.4f} ms {3 * gemm / ms / 1e9:.0f} TFLOP/s", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name} dQ {cfg}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
