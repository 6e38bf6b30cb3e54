"""Probe for out-of-bounds accesses: forward and backward of the attention op on the GPU kernels' edge cases
(query and key tails, causal, key padding, GQA, D = 64 / 128, the pair and the fused sm_90 backward), meant
to run under ``compute-sanitizer --tool memcheck``, which flags an access outside any allocation even where
it would not fault (an intermittent illegal address, run93, may be such an access landing in unmapped memory
only under other workers' allocations). ``--int64`` adds the int64-offset shape of
``tests/test_attention.py::test_gpu_int64_offsets`` (2.28e9 elements per tensor; slow under memcheck).

Usage (GPU): ``compute-sanitizer --tool memcheck --print-limit 20 python benchmarks/dev/attention_memcheck.py``.
With ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` every tensor is its own allocation, so an access past a tensor but
inside the caching allocator's segment is flagged too. Run98-99 found nothing here alone; the run93 bug needed
other GPU load (``gpu_hog.py`` beside ``attention_int64_stages.py``), and memcheck under that load named it
(run105)."""
from __future__ import annotations

import os
import sys

import torch

import pykernels

CASES = [  # (B, Hq, Hkv, Sq, Sk, D, causal, key padding, PYKERNELS_ATTN_SM90_BWD)
    (64, 4, 4, 136, 136, 128, True, False, None),  # the int64 test's structure at a small batch
    (3, 4, 4, 1000, 1000, 128, False, False, None),
    (3, 4, 4, 1000, 1000, 128, True, False, None),
    (2, 8, 2, 333, 1000, 128, True, False, None),  # GQA, Sq != Sk
    (8, 4, 4, 2100, 2100, 128, False, False, "fused"),
    (8, 4, 4, 2100, 2100, 128, True, False, "fused"),
    (4, 6, 6, 700, 700, 64, False, True, None),  # key padding (sm_90 forward)
    (4, 6, 6, 1100, 1100, 64, True, False, None),
    (1, 2, 2, 1, 1, 128, False, False, None),
    (2, 3, 3, 17, 17, 64, True, False, None),
]


def run(b, hq, hkv, sq, sk, d, causal, pad, bwd) -> None:
    if bwd is None:
        os.environ.pop("PYKERNELS_ATTN_SM90_BWD", None)
    else:
        os.environ["PYKERNELS_ATTN_SM90_BWD"] = bwd
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    mask = None
    if pad:
        lengths = torch.randint(1, sk + 1, (b,), device="cuda")
        mask = (torch.arange(sk, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    o = pykernels.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=hq != hkv)
    o.backward(torch.randn_like(o))
    torch.cuda.synchronize()
    ok = all(torch.isfinite(t).all().item() for t in (o, q.grad, k.grad, v.grad))
    print(f"B{b} H{hq}/{hkv} Sq{sq} Sk{sk} D{d} causal={causal} pad={pad} bwd={bwd}: finite={ok}", flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return
    torch.manual_seed(0)
    for case in CASES:
        run(*case)
    if "--int64" in sys.argv:
        run(8192, 16, 16, 136, 136, 128, True, False, None)


if __name__ == "__main__":
    main()
