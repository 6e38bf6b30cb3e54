"""Where ``auto``'s C++ forward kernel (``pykernels.attention.AUTO_CUDA_FWD``: D <= 64, not causal, on Hopper) beats
the forward the Triton backend would run (the sm_90 Gluon kernel from 512 keys, ``attention_sm90.preferred``; the
Triton kernel below): both forwards alone, CUDA-graph replay, bf16, D = 64, bidirectional, over batch x heads at
BERT's lengths, alternating the two in rounds (the least of each). One line a shape: ms and TFLOP/s of each, C++ /
other. Usage (sm_90 GPU, the extension built): ``python benchmarks/dev/attention_cuda_fwd_rule.py [--rounds 3]``. H200 run477
(``benchmarks/results/attention_cuda_fwd_rule_*_run477.txt``) set ``pykernels.attention._cpp_fwd_rounds_win``."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_sm90_gluon_ws import graph_ms  # noqa: E402

from pykernels._backend import cuda_ops_ready  # noqa: E402
from pykernels._kernels import attention as katt  # noqa: E402

SHAPES = [(32, 12, 512), (16, 16, 512), (16, 12, 512), (24, 16, 512), (32, 16, 512), (64, 12, 512), (8, 16, 512),
          (48, 16, 512), (8, 12, 1024), (8, 16, 1024), (16, 16, 1024), (4, 16, 2048)]


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if not cuda_ops_ready():  # (imports pykernels._C, which registers torch.ops.pykernels_cuda)
        raise SystemExit("the CUDA extension pykernels._C is not built here")
    for b, h, s in SHAPES:
        q, k, v = (torch.randn(b, h, s, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        sc = 0.125
        flops = 4 * b * h * s * s * 64
        cpp = lambda: torch.ops.pykernels_cuda.attention_fwd(q, k, v, None, None, None, s, s, 0.0, False, sc, None)  # noqa: E731
        tri = lambda: katt.attention_fwd(q, k, v, None, causal=False, scale=sc, dropout_p=0.0, seed=0)  # noqa: E731
        gluon = katt.sm90_forward(q, k, v, None, dropout_p=0.0, scale=sc)
        err = (cpp()[0].float() - tri()[0].float()).abs().max().item()
        t_c, t_t = [], []
        for _ in range(rounds):
            t_c.append(graph_ms(cpp))
            t_t.append(graph_ms(tri))
        c, t = min(t_c), min(t_t)
        print(f"B{b} H{h} S{s} D64: C++ {c:.4f} ms {flops / c / 1e9:.0f} TFLOP/s, {'Gluon' if gluon else 'Triton'} "
              f"{t:.4f} ms {flops / t / 1e9:.0f}; C++ / other {t / c:.3f}x; max |o diff| {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
