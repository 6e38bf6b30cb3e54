"""The attention backward at D = 256 on Hopper: the Gluon dQ kernel (``kernels/attention_sm90_bwd.py``,
``DQ_CONFIGS[256]``; delta formed in it, Triton's dK/dV kernel beside it) against the Triton backward's two kernels,
and cuDNN's backward, every variant in one process, alternating in rounds. Timing: ``attention_dropout_kernels.
time_case`` (kernel time a call, and one call's CUDA-graph replay); bf16, no dropout, the Gluon forward for all of
ours. One line a variant: ``shape variant fwd_us bwd_us graph_fwd_us graph_bwd_us bwd_TFLOPs`` (graph replay; the
backward's 2.5x the forward's matmul FLOPs), then the dQ difference against the Triton kernels'.

Usage (sm_90 GPU): ``python benchmarks/dev/attention_bwd_d256.py [--rounds 2]``."""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention_dropout_kernels import time_case  # noqa: E402  (the dev timing, same directory)

import pykernels  # noqa: E402
from pykernels._kernels import attention_sm90_bwd as kb  # noqa: E402

SHAPES = [(4, 8, 4096, True), (4, 8, 2048, False), (2, 8, 8192, False), (16, 16, 512, False), (1, 8, 8192, True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print("#", torch.cuda.get_device_name(), "torch", torch.__version__, "DQ_CONFIGS[256]", kb.DQ_CONFIGS[256])

    def ours(q, k, v, causal, mask, cu=None, max_len=0):
        return pykernels.scaled_dot_product_attention(q, k, v, is_causal=causal, backend="triton")

    def cudnn(q, k, v, causal, mask, cu=None, max_len=0):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    default = kb.DQ_CONFIGS[256]
    variants = [("gluon-dq", "dq", default), ("gluon-dq-64x16x4", "dq", (64, 16, 4)), ("triton", "", default),
                ("cudnn", None, default)]
    for b, h, s, causal in SHAPES:
        name = f"B{b} H{h} S{s} D256 {'causal' if causal else 'full'}"
        flops = 2.5 * 4 * b * h * s * s * 256 / (2 if causal else 1)
        for _ in range(args.rounds):
            for label, which, cfg in variants:
                if which is not None:
                    os.environ["PYKERNELS_ATTN_SM90_BWD"] = which
                kb.DQ_CONFIGS[256] = cfg
                try:
                    f_us, b_us, (gf, gb) = time_case(cudnn if which is None else ours, b, h, s, 256, causal, 5,
                                                     graph=True)
                    print(f"{name} {label} {f_us:.1f} {b_us:.1f} {gf:.1f} {gb:.1f} {flops / gb / 1e6:.0f}", flush=True)
                except Exception as e:  # report and go on: this is a probe
                    print(f"{name} {label} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
        kb.DQ_CONFIGS[256] = default
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (torch.randn(b, h, s, 256, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        do = torch.randn_like(q)
        got = {}
        for which in ("dq", ""):
            os.environ["PYKERNELS_ATTN_SM90_BWD"] = which
            got[which] = torch.autograd.grad(ours(q, k, v, causal, None), (q, k, v), do)
        diff = [(x.float() - y.float()).abs().max().item() for x, y in zip(got["dq"], got[""])]
        print(f"{name} max |gluon - triton| dq {diff[0]:.2e} dk {diff[1]:.2e} dv {diff[2]:.2e} "
              f"(max |dq| {got[''][0].float().abs().max().item():.2e})", flush=True)
    os.environ.pop("PYKERNELS_ATTN_SM90_BWD", None)


if __name__ == "__main__":
    main()
