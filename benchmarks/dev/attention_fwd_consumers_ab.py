"""The C++ forward's consumer warpgroups (csrc/attention.cuh, fwd_three_consumers / fwd_three_pad_ok) A/B in one process:
each round times every case under each setting of ``PYKERNELS_CUDA_ATTN_FWD_WG`` (read at every call, so each graph
is captured under its own setting) by the attention benchmark's CUDA-graph replay (``benchmarks/attention.graph_time``:
forward, and forward+backward less the forward), through the C++ backend and through ``auto`` (the C++ forward with
the Triton backward), settings alternating within the round so that the card's clock drifts over both alike; cuDNN's
(torch SDPA) once a case in the first round.

A setting may also be ``NAME=VALUE[,NAME=VALUE]`` (common.env_settings: names without their ``PYKERNELS_`` prefix, e.g.
``CUDA_ATTN_FWD_WG=3,CUDA_ATTN_FWD_MIX=0``), each variable the others leave unset. The ``kp`` cases carry a boolean
key-padding mask (``CUDA_ATTN_FWD_RANGES=0`` against ``default``: the forward split by key ranges or not), and their
peer lines are cuDNN's and FlexAttention's on that mask.

One line a case, implementation, setting and round: ``SETTING round case impl fwd_us bwd_us fwdbwd_us``.

Usage (GPU): ``python benchmarks/dev/attention_fwd_consumers_ab.py [--rounds 3] [--settings "3;default"]
[--cases s128,s256,s512] [--impls cuda,auto,triton]`` (``default``: the variable unset, the rule; ``3`` three consumers
forced, ``2`` two; ``triton``: the Triton backend's forward and backward, which the variable does not touch: what
``auto`` would take instead of the C++ forward).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402  (benchmarks/common.py)
from attention import (Case, bert_lengths, flex_impl, graph_time, key_padding_mask,  # noqa: E402
                       sdpa_impl)  # (benchmarks/attention.py)

import pykernels  # noqa: E402

# (batch, heads, tokens[, D, causal]), D = 64 and not causal unless given; ``kp`` cases: a boolean key-padding
# mask, the attention benchmark's lengths (uniform in [S/2, S], its seed: bert_lengths), whose peer line is
# cuDNN's and FlexAttention's with that mask; ``c`` cases causal (the Gluon forward's tile table,
# ``ATTN_SM90_ORDER``: GPT-2, the benchmark's S4096 / S8192 D = 128 causal rows, and odd head counts)
CASES = {"s100": (128, 12, 100), "s128": (128, 12, 128), "s256": (64, 12, 256), "s300": (48, 12, 300),
         "s384": (40, 12, 384), "s512": (32, 12, 512), "s1000": (16, 12, 1000), "kp512": (32, 12, 512),
         "kp1000": (16, 12, 1000), "cgpt2": (8, 12, 1024, 64, True), "c1k": (16, 16, 1024, 128, True),
         "c2k": (3, 12, 2048, 128, True), "c4k": (4, 16, 4096, 128, True), "c8k": (2, 16, 8192, 128, True)}
# (unset by every setting that does not name them)
VARS = ("CUDA_ATTN_FWD_WG", "CUDA_ATTN_FWD_MIX", "CUDA_ATTN_FWD_RANGES", "ATTN_SM90_ORDER")


def case_shape(case: str) -> tuple:
    """(batch, heads, tokens, D, causal) of a case."""
    b, h, s, *rest = CASES[case]
    return (b, h, s, *(rest or (64, False)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settings", default="3;default")
    ap.add_argument("--cases", default="s128,s256,s512")
    ap.add_argument("--impls", default="cuda,auto", help="comma-separated: cuda, auto, triton")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}")
    impls = {name: (lambda q, k, v, mask, causal, name=name: pykernels.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, backend=name)) for name in args.impls.split(",")}

    def line(label, rnd, case, name, g):
        f, b = g.get("graph_fwd_ms", float("nan")) * 1e3, g.get("graph_bwd_ms", float("nan")) * 1e3
        print(f"{label} {rnd} {case} {name} {f:.1f} {b:.1f} {f + b:.1f}", flush=True)

    inputs = {}
    for case in args.cases.split(","):
        b, h, s, d, causal = case_shape(case)
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        lengths = bert_lengths(b, s // 2, s) if case.startswith("kp") else None
        mask = key_padding_mask(lengths, s) if lengths is not None else None
        inputs[case] = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do, mask, lengths, causal)
    for rnd in range(args.rounds):
        for case, (q, k, v, do, mask, lengths, causal) in inputs.items():
            if rnd == 0:  # the peers (the benchmark's): cuDNN; FlexAttention with its block mask where padded
                cudnn = sdpa_impl(mask, causal, torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
                line("cudnn", rnd, case, "sdpa", graph_time(cudnn, q, k, v, do))
                if mask is not None:
                    b, h, s, _, _ = case_shape(case)
                    flex = flex_impl(Case(case, b, h, s, 64, key_padding=True), lengths)
                    line("flex", rnd, case, "flex", graph_time(flex, q, k, v, do))
            for setting in args.settings.split(";"):  # (default: the variables unset)
                env = dict.fromkeys(VARS)
                if "=" in setting:
                    env.update(common.env_settings(setting)[0])
                elif setting != "default":
                    env["CUDA_ATTN_FWD_WG"] = setting
                with common.env_setting(env):
                    for name, fn in impls.items():
                        line(setting, rnd, case, name,
                             graph_time(lambda q, k, v, fn=fn, mask=mask, causal=causal: fn(q, k, v, mask, causal),
                                        q, k, v, do))
    return 0


if __name__ == "__main__":
    sys.exit(main())
