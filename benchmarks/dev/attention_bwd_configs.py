"""The Triton attention backward's tile configs at D = 64 and 256 (and the forward's at 256), timed by the autotuner.

The D = 64 backwards (BERT-base, BERT key padding, GPT-2 causal) run the Triton dK/dV and dQ kernels on every
card (the Gluon backward is 0.72-0.87x them there, run96). Their autotuner chooses among the entries of
``kernels.attention._TABLE["dkdv"][64]`` and ``["dq"][64]``; this probe widens both lists with candidates, runs
one forward+backward per case so that the autotuner times every candidate (``triton.testing.do_bench`` on the
case's own arguments, as in any benchmark run), and prints each kernel's timings best first, next to the
configs the package's table holds. The gradients of the tuned call are compared with the table's own choice.

The seventy-eighth session added the D = 256 tier (``d256_causal``, ``d256_bidir``: the attention matrix's shapes, where
the Triton backward ran at 77-82 TFLOP/s on an H200, run469), its candidates screened for spills on the CPU first
(``attention_triton_bwd_codegen.py --cases d256_causal``), and the forward kernel's candidates there.

Usage: ``python benchmarks/dev/attention_bwd_configs.py [--cases bert,bertpad,gpt2,d256_causal,d256_bidir]`` (GPU only)
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("PYKERNELS_AUTOTUNE", "1")

import torch  # noqa: E402
import triton  # noqa: E402

import pykernels  # noqa: E402
from pykernels._kernels import _launch  # noqa: E402
from pykernels._kernels import attention as katt  # noqa: E402

CASES = {  # name -> (B, H, S, D, causal, key padding)
    "bert": (32, 12, 512, 64, False, False),
    "bertpad": (32, 12, 512, 64, False, True),
    "gpt2": (8, 12, 1024, 64, True, False),
    "d256_causal": (4, 8, 4096, 256, True, False),
    "d256_bidir": (4, 8, 2048, 256, False, False),
}
# (BLOCK_M, BLOCK_N, warps, stages); dK/dV: BLOCK_N % BLOCK_M == 0, dQ: BLOCK_M % BLOCK_N == 0
DKDV = {64: [(32, 64, 4, 2), (32, 64, 4, 4), (16, 64, 4, 3), (16, 64, 4, 4), (64, 64, 4, 2), (64, 64, 4, 3),
             (32, 128, 4, 2), (32, 128, 4, 3), (16, 128, 4, 3), (64, 128, 4, 2), (16, 128, 8, 3), (128, 128, 8, 2)],
        # D = 256 (sm_90 ptxas, no dropout): 16x32/4 244 registers, 32x32/8 174, 16x16/4 162, 32x32/4 32 B spilled,
        # 32x64/8 1032 B, 64x64/8 1368 B, every BLOCK_N = 64 with 4 warps over 4 KB
        # (run471's candidates; the table took 64x64/w8/s2 first)
        256: [(16, 32, 4, 3), (32, 32, 8, 2), (32, 32, 8, 3), (32, 32, 4, 2), (16, 16, 4, 2), (16, 32, 8, 2),
              (32, 64, 8, 2), (64, 64, 8, 2), (64, 64, 8, 1), (32, 64, 8, 3), (32, 32, 4, 3)]}
DQ = {64: [(64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 3), (64, 32, 4, 4), (32, 32, 4, 3), (64, 16, 4, 3),
           (128, 64, 4, 2), (128, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2), (128, 128, 8, 3), (32, 16, 4, 4)],
      # D = 256: 32x32/8 254 registers; 128x32/8 156 B spilled, 128x16/8 164, 64x16/8 192, 32x16/4/3 16
      256: [(32, 32, 8, 2), (32, 32, 8, 3), (128, 32, 8, 2), (128, 16, 8, 2), (64, 16, 8, 2), (32, 16, 4, 3),
            (32, 32, 4, 2), (64, 32, 8, 2), (128, 32, 8, 3), (128, 64, 8, 1), (128, 16, 8, 3), (64, 16, 8, 3)]}
# D = 256 forward: 128x32/8/s3 spill-free at 255 registers, 128x32/8/s2 12 B, 64x64/8 1368 B, 64x32/4 728 B
FWD = {256: [(128, 32, 8, 3), (128, 32, 8, 2), (64, 32, 8, 3), (64, 16, 8, 2), (128, 16, 8, 2), (64, 64, 8, 2),
             (64, 32, 4, 2), (128, 32, 8, 4), (128, 64, 8, 2), (128, 16, 8, 3), (64, 32, 4, 3)]}


def _widen(kernel, kind: str, tier: int, extra: list[tuple]) -> list[tuple]:
    have = {_key(c) for c in kernel.configs}
    for bm, bn, w, st in extra:
        if (bm, bn, w, st) not in have:
            kernel.configs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st))
    table = list(katt._TABLE[kind][tier])
    katt._TABLE[kind][tier] = table + [c for c in extra if c not in table]
    return table


def _forget(*kernels) -> None:
    """Drop the autotuner's choice and the fast launcher's cached launch (which bypasses the autotuner)."""
    for k in kernels:
        k.cache.clear()
        _launch.fast(k).cache.clear()


def _key(cfg) -> tuple:
    """A config as the tables write it: (BLOCK_M, BLOCK_N, warps, stages)."""
    return cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages


def _name(cfg) -> str:
    return f"{cfg.kwargs['BLOCK_M']}x{cfg.kwargs['BLOCK_N']}/w{cfg.num_warps}/s{cfg.num_stages}"


def _grads(b, h, s, d, causal, pad, dtype=torch.bfloat16):
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn(b, h, s, d, device="cuda", dtype=dtype)
    mask = None
    if pad:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(s // 2, s + 1, (b,), generator=g)
        mask = (torch.arange(s)[None, :] < lengths[:, None])[:, None, None, :].cuda()
    o = pykernels.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, backend="triton")
    o.backward(do)
    torch.cuda.synchronize()
    return q.grad, k.grad, v.grad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="bert,bertpad,gpt2")
    ap.add_argument("--repeat", type=int, default=1, help="times each case (the autotuner's timings anew each time)")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
          "Triton attention (backward at D = 64 and 256, forward at 256), bf16, autotuner do_bench per config")
    dkdv_k, dq_k, fwd_k = katt._attention_bwd_dkdv_kernel, katt._attention_bwd_dq_kernel, katt._attention_fwd_kernel
    for name in [c for c in args.cases.split(",") for _ in range(args.repeat)]:
        b, h, s, d, causal, pad = CASES[name]
        tier = katt._tier(d)
        kerns = [("dkdv", dkdv_k, DKDV), ("dq", dq_k, DQ)] + ([("fwd", fwd_k, FWD)] if tier in FWD else [])
        base = {kind: katt._TABLE[kind][tier] for kind, _, _ in kerns}
        _forget(*(k for _, k, _ in kerns))
        ref = _grads(b, h, s, d, causal, pad)  # the table's own choice
        picked = {kind: _key(k.best_config) for kind, k, _ in kerns}
        for kind, k, cands in kerns:
            _widen(k, kind, tier, cands[tier])
        _forget(*(k for _, k, _ in kerns))
        got = _grads(b, h, s, d, causal, pad)
        diff = max((a.float() - r.float()).abs().max().item() for a, r in zip(got, ref))
        print(f"\n== {name}: B{b} H{h} S{s} D{d} causal={causal} key_padding={pad}; the table picked {picked}; "
              f"gradients with the widened choice differ from it by at most {diff:.3g}")
        for label, kern, _ in kerns:
            timings = sorted(kern.configs_timings.items(), key=lambda kv: kv[1][0])
            for cfg, t in timings:
                print(f"  {label:5s} {_name(cfg):16s} {t[0] * 1e3:8.1f} us"
                      f"{'   (table)' if _key(cfg) in base[label] else ''}")
        for kind, _, _ in kerns:
            katt._TABLE[kind][tier] = base[kind]
        _forget(*(k for _, k, _ in kerns))


if __name__ == "__main__":
    main()
