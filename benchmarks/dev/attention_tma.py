"""Forward TFLOP/s of pykernels attention with and without tensor descriptors (TMA), next to cuDNN, on
the ANCHORS shapes (CUDA-graph replay, bf16). Usage (GPU): ``python benchmarks/dev/attention_tma.py``"""
from __future__ import annotations

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import pykernels
from pykernels._kernels import attention as kattn

SHAPES = [("bert", 32, 12, 512, 64, False), ("gpt2", 8, 12, 1024, 64, True),
          ("4k-causal", 4, 16, 4096, 128, True), ("8k", 2, 16, 8192, 128, False),
          ("8k-causal", 2, 16, 8192, 128, True)]


def main() -> None:
    for name, b, h, s, d, causal in SHAPES:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        out = {}
        for tag, tma in (("pointer", False), ("tma", True)):
            kattn.USE_TMA = tma
            fn = lambda: pykernels.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
            fn()
            out[tag] = flops / triton.testing.do_bench_cudagraph(fn, rep=50) / 1e9
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
            fn()
            out["cudnn"] = flops / triton.testing.do_bench_cudagraph(fn, rep=50) / 1e9
        cfg = kattn._attention_fwd_kernel.best_config
        print(f"{name:10s} " + "  ".join(f"{k} {v:6.1f}" for k, v in out.items()) + f"  (last config {cfg})", flush=True)
    kattn.USE_TMA = True


if __name__ == "__main__":
    main()
