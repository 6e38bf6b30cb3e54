"""A/B of the varlen forward: the sm_90 Gluon kernel (``attention_sm90.attention_fwd_sm90_varlen``) against
the Triton kernel on the same packed batch, in one process, graph replay (GPU time), outputs compared. Lengths
uniform in [S / 2, S] (the benchmark's BERT batch is B32, 256..512), tokens ~16k, H12. The rule
(``attention_sm90.VARLEN_HEAD_DIMS``: D = 128 only) comes from this sweep (run113).

Usage (GPU): ``python benchmarks/dev/attention_varlen_ab.py``.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_sm90_gluon_ws import graph_ms  # noqa: E402

from pykernels._kernels import attention as katt  # noqa: E402


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: varlen forward, Gluon vs Triton, graph "
          f"replay (best of 3 alternating), TFLOP/s over the sequences' own work")
    orig = katt.sm90_varlen_forward
    for d, causal in ((64, False), (128, False), (128, True)):
        for s in (128, 256, 384, 512, 1024, 2048):
            b = max(1, 16384 // s)
            g = torch.Generator().manual_seed(s)
            lens = torch.randint(s // 2, s + 1, (b,), generator=g)
            lens[0] = s
            cu = torch.zeros(b + 1, dtype=torch.int32)
            cu[1:] = lens.cumsum(0)
            cu = cu.cuda()
            t = int(cu[-1])
            q, k, v = (torch.randn(t, 12, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * 12 * d * float((lens.double() ** 2).sum()) * (0.5 if causal else 1.0)

            def fwd():
                return katt.attention_fwd(q, k, v, None, causal=causal, scale=d ** -0.5, dropout_p=0.0, seed=0,
                                          cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s)
            took = orig(q, k, v, cu, cu, s, s, dropout_p=0.0, scale=d ** -0.5, causal=causal)
            best, outs = {}, {}
            try:
                for _ in range(3):
                    for tag in ("gluon", "triton"):
                        katt.sm90_varlen_forward = (lambda *a, **kw: True) if tag == "gluon" else (lambda *a, **kw: False)
                        outs[tag] = fwd()
                        best[tag] = min(best.get(tag, 1e9), graph_ms(fwd))
            finally:
                katt.sm90_varlen_forward = orig
            diff = (outs["gluon"][0].float() - outs["triton"][0].float()).abs().max().item()
            lse_ok = torch.equal(torch.isinf(outs["gluon"][1]), torch.isinf(outs["triton"][1]))
            print(f"D{d} {'causal' if causal else 'full  '} S{s:5d} B{b:3d} tokens {t}: gluon {best['gluon'] * 1e3:7.1f} us "
                  f"({flops / best['gluon'] * 1e-9:5.1f}), triton {best['triton'] * 1e3:7.1f} us "
                  f"({flops / best['triton'] * 1e-9:5.1f}), speed-up {best['triton'] / best['gluon']:.3f}x; "
                  f"max |o diff| {diff:.1e}, lse -inf rows equal {lse_ok}; the rule takes gluon: {took}", flush=True)


if __name__ == "__main__":
    main()
