"""Does the memory layout change pykernels attention's speed? BERT-base shape (B32 H12 S512 D64, bf16),
forward and forward+backward in CUDA-graph replay, for q/k/v contiguous (B, H, S, D), the
(B, S, H, D).transpose(1, 2) views Hugging Face models pass, and the packed varlen layout with every
sequence full length. Usage (GPU): ``python benchmarks/dev/attention_layout.py``"""
from __future__ import annotations

import torch
import triton.testing

import pykernels
from pykernels._kernels import attention as kattn


def timed(fn, *ins):
    def step():
        out = fn(*ins)
        out.backward(torch.ones_like(out))
    fwd = triton.testing.do_bench_cudagraph(lambda: fn(*ins), rep=50)
    for t in ins:
        t.grad = None
    both = triton.testing.do_bench_cudagraph(step, rep=50)
    return fwd, both - fwd


def main() -> None:
    b, h, s, d = 32, 12, 512, 64
    flops = 4 * b * h * s * s * d
    mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    bhsd = [mk(b, h, s, d) for _ in range(3)]
    bshd = [mk(b, s, h, d) for _ in range(3)]
    packed = [mk(b * s, h, d) for _ in range(3)]
    cu = torch.arange(0, b * s + 1, s, device="cuda", dtype=torch.int32)
    cases = {
        "contiguous (B,H,S,D)": (lambda q, k, v: pykernels.scaled_dot_product_attention(q, k, v), bhsd),
        "HF view (B,S,H,D).transpose(1,2)": (lambda q, k, v: pykernels.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)), bshd),
        "varlen packed, all length 512": (lambda q, k, v: pykernels.varlen_attention(q, k, v, cu, cu, s, s), packed),
    }
    for name, (fn, ins) in cases.items():
        f, bwd = timed(fn, *ins)
        print(f"{name:36s} fwd {f:.4f} ms ({flops / f / 1e9:5.1f} TFLOP/s)  bwd {bwd:.4f} ms "
              f"({2.5 * flops / bwd / 1e9:5.1f} TFLOP/s)  configs fwd {kattn._attention_fwd_kernel.best_config}",
              flush=True)


if __name__ == "__main__":
    main()
