"""The Triton attention backward's tile configs at D = 64, timed by its own autotuner (GPU only).

The D = 64 backwards (BERT-base, BERT key padding, GPT-2 causal) run the Triton dK/dV and dQ kernels on every
card (the Gluon backward is 0.72-0.87x them there, run96). Their autotuner chooses among the entries of
``kernels.attention._TABLE["dkdv"][64]`` and ``["dq"][64]``; this probe widens both lists with candidates, runs
one forward+backward per case so that the autotuner times every candidate (``triton.testing.do_bench`` on the
case's own arguments, as in any benchmark run), and prints each kernel's timings best first, next to the
configs the package's table holds. The gradients of the tuned call are compared with the table's own choice.

Usage: ``python benchmarks/dev/attention_bwd_configs.py [--cases bert,bertpad,gpt2]``
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
}
# (BLOCK_M, BLOCK_N, warps, stages); dK/dV: BLOCK_N % BLOCK_M == 0, dQ: BLOCK_M % BLOCK_N == 0
DKDV = [(32, 64, 4, 2), (32, 64, 4, 4), (16, 64, 4, 3), (16, 64, 4, 4), (64, 64, 4, 2), (64, 64, 4, 3),
        (32, 128, 4, 2), (32, 128, 4, 3), (16, 128, 4, 3), (64, 128, 4, 2), (16, 128, 8, 3), (128, 128, 8, 2)]
DQ = [(64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 3), (64, 32, 4, 4), (32, 32, 4, 3), (64, 16, 4, 3),
      (128, 64, 4, 2), (128, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2), (128, 128, 8, 3), (32, 16, 4, 4)]


def _widen(kernel, kind: str, extra: list[tuple]) -> list[tuple]:
    have = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kernel.configs}
    for bm, bn, w, st in extra:
        if (bm, bn, w, st) not in have:
            kernel.configs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st))
    table = list(katt._TABLE[kind][64])
    katt._TABLE[kind][64] = table + [c for c in extra if c not in table]
    return table


def _forget(*kernels) -> None:
    """Drop the autotuner's choice and the fast launcher's cached launch (which bypasses the autotuner)."""
    for k in kernels:
        k.cache.clear()
        _launch.fast(k).cache.clear()


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
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
          "Triton attention backward at D = 64, bf16, autotuner do_bench per config (ms)")
    dkdv_k, dq_k = katt._attention_bwd_dkdv_kernel, katt._attention_bwd_dq_kernel
    for name in args.cases.split(","):
        b, h, s, d, causal, pad = CASES[name]
        base = (katt._TABLE["dkdv"][64], katt._TABLE["dq"][64])
        ref = _grads(b, h, s, d, causal, pad)  # the table's own choice
        table_dkdv, table_dq = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                                for c in (dkdv_k.best_config, dq_k.best_config)]
        _widen(dkdv_k, "dkdv", DKDV)
        _widen(dq_k, "dq", DQ)
        _forget(dkdv_k, dq_k)
        got = _grads(b, h, s, d, causal, pad)
        diff = max((a.float() - r.float()).abs().max().item() for a, r in zip(got, ref))
        print(f"\n== {name}: B{b} H{h} S{s} D{d} causal={causal} key_padding={pad}; the table picked dkdv {table_dkdv}, "
              f"dq {table_dq}; gradients with the widened choice differ from it by at most {diff:.3g}")
        for label, kern, tab in (("dkdv", dkdv_k, base[0]), ("dq", dq_k, base[1])):
            timings = sorted(kern.configs_timings.items(), key=lambda kv: kv[1][0])
            for cfg, t in timings:
                key = (cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages)
                print(f"  {label:5s} {_name(cfg):16s} {t[0] * 1e3:8.1f} us{'   (table)' if key in tab else ''}")
        katt._TABLE["dkdv"][64], katt._TABLE["dq"][64] = base
        _forget(dkdv_k, dq_k)


if __name__ == "__main__":
    main()
