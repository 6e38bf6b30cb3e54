"""The Triton backend's sm_90 Gluon backward at a causal D = 128 shape under its order knobs (kernels/
attention_sm90_bwd.py): the longest-first order on or off (``CAUSAL_LPT``) and the L2 budget of its head groups
(``LPT_L2_BYTES``), each with the fused kernel and the pair (``PYKERNELS_ATTN_SM90_BWD``); with ``--tail``, the
last head groups merged or not (``LPT_TAIL_GROUPS`` 2 / 1) at the default order; with ``--kernels`` (and ``--full``
for bidirectional attention, ``--hkv N`` for N key / value heads: GQA), the fused kernel against the pair at the
default knobs (``FUSED_MIN_SK``, ``FUSED_CAUSAL_MIN_SK``). A development sweep for
choosing those constants; the timing is benchmarks/dev/attention_dropout_kernels.py's (kernel time a call, and one
call's CUDA-graph replay), every variant in the same process.

Usage (GPU): ``python benchmarks/dev/attention_bwd_lpt_sweep.py [--shape 4,16,4096] [--rounds 2] [--tail |
--kernels [--full] [--hkv 8]]``. One
line a variant: ``kernels lpt budget_MiB merged_groups fwd_us bwd_us graph_fwd_us graph_bwd_us``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention_dropout_kernels import time_case  # noqa: E402  (the dev timing, same directory)

import pykernels  # noqa: E402
from pykernels._kernels import attention_sm90_bwd as kb  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4,16,4096", help="batch, heads, sequence (D = 128, causal)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tail", action="store_true", help="LPT_TAIL_GROUPS 1 against 2 only")
    ap.add_argument("--kernels", action="store_true", help="the fused kernel against the pair only, default knobs")
    ap.add_argument("--full", action="store_true", help="bidirectional (with --kernels)")
    ap.add_argument("--hkv", type=int, default=0, help="key / value heads (GQA; with --kernels)")
    args = ap.parse_args()
    b, h, s = (int(x) for x in args.shape.split(","))
    causal = not args.full
    print("#", torch.cuda.get_device_name(), "torch", torch.__version__,
          f"B{b} H{h}{'/' + str(args.hkv) if args.hkv else ''} S{s} D128 {'causal' if causal else 'full'} bf16")

    def run(q, k, v, causal, mask, cu=None, max_len=0):
        return pykernels.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, backend="triton",
                                                      enable_gqa=k.shape[1] != q.shape[1])

    if args.kernels:
        variants = [(kernels, kb.CAUSAL_LPT, kb.LPT_L2_BYTES >> 20, kb.LPT_TAIL_GROUPS)
                    for kernels in ("fused", "dkdv,dq")]
    elif args.tail:
        variants = [(kernels, True, 12, merged) for kernels in ("fused", "dkdv,dq") for merged in (1, 2)]
    else:
        variants = [(kernels, lpt, mib, 2) for kernels in ("fused", "dkdv,dq")
                    for lpt, mib in ((True, 12), (True, 6), (True, 24), (True, 48), (True, 0), (False, 12))]
    for _ in range(args.rounds):
        for kernels, lpt, mib, merged in variants:
            os.environ["PYKERNELS_ATTN_SM90_BWD"] = kernels
            kb.CAUSAL_LPT, kb.LPT_L2_BYTES, kb.LPT_TAIL_GROUPS = lpt, mib << 20, merged
            f_us, b_us, (gf, gb) = time_case(run, b, h, s, 128, causal, 10, graph=True, hkv=args.hkv)
            print(f"{kernels} {int(lpt)} {mib} {merged} {f_us:.1f} {b_us:.1f} {gf:.1f} {gb:.1f}", flush=True)


if __name__ == "__main__":
    main()
