"""Diagnosis of branch next/varlen-order's bitwise mismatch (run307): the C++ forward over packed sequences with the
ordered walk (default) against tile_at's walk (PYKERNELS_CUDA_ATTN_FWD_ORDER=0), o and lse compared per sequence and
head, then the deterministic backward run twice on the same inputs (is it reproducible at all?) and once per walk.
Usage (GPU): python benchmarks/dev/fwd_order_diag.py"""
from __future__ import annotations

import os

import torch

import pykernels._C  # noqa: F401  (registers torch.ops.pykernels_cuda)

op = torch.ops.pykernels_cuda


def case(n, d, causal, hkv, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 700 if n <= 300 else 40, (n,), generator=g).tolist()
    lengths[0] = 0
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    t = int(cu[-1])
    q = torch.randn(t, 4, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    mx = max(lengths)
    sc = d ** -0.5

    def fwd(env):
        if env is None:
            os.environ.pop("PYKERNELS_CUDA_ATTN_FWD_ORDER", None)
        else:
            os.environ["PYKERNELS_CUDA_ATTN_FWD_ORDER"] = env
        o, lse, seed_t = op.attention_fwd(q, k, v, None, cu, cu, mx, mx, 0.0, causal, sc)
        torch.cuda.synchronize()
        return o, lse, seed_t

    print(f"## n={n} d={d} causal={causal} hkv={hkv} total={t} lse {tuple(fwd(None)[1].shape)}")
    runs = {}
    for env in (None, "0", None, "0"):
        runs.setdefault(env, []).append(fwd(env))
    for env, rs in runs.items():
        print(f"  env={env}: o repeat equal {torch.equal(rs[0][0], rs[1][0])}, lse {torch.equal(rs[0][1], rs[1][1])}")
    (oa, la, _), (ob, lb, _) = runs[None][0], runs["0"][0]
    print(f"  order vs rr: o equal {torch.equal(oa, ob)}, lse equal {torch.equal(la, lb)}")
    if not torch.equal(oa, ob):
        diff = (oa.float() - ob.float()).abs().amax(-1)  # (T, H)
        for i in range(n):
            s, e = int(cu[i]), int(cu[i + 1])
            if e > s and diff[s:e].max() > 0:
                rows = (diff[s:e] > 0).nonzero()
                print(f"    seq {i} len {e - s}: max diff {diff[s:e].max().item():.3e}, {rows.shape[0]} (row, head)"
                      f" pairs, rows {rows[:, 0].min().item()}..{rows[:, 0].max().item()}, heads "
                      f"{sorted(set(rows[:, 1].tolist()))}")
    # which is right: each against a float32 reference of the first differing sequences
    do = torch.randn_like(oa)
    for name, (o, lse, seed_t) in (("order", runs[None][0]), ("rr", runs["0"][0])):
        g1 = op.attention_bwd(do, q, k, v, o, lse, None, cu, cu, mx, mx, 0.0, causal, sc, seed_t, True)
        g2 = op.attention_bwd(do, q, k, v, o, lse, None, cu, cu, mx, mx, 0.0, causal, sc, seed_t, True)
        print(f"  bwd deterministic on {name}'s o/lse, twice: " + ", ".join(
            f"{nm} {torch.equal(a, b)}" for nm, a, b in zip(("dq", "dk", "dv"), g1, g2)))
        runs[name] = g1
    print("  bwd order vs rr: " + ", ".join(f"{nm} {torch.equal(a, b)}"
                                            for nm, a, b in zip(("dq", "dk", "dv"), runs["order"], runs["rr"])))
    errs = {"order": 0.0, "rr": 0.0}
    for i in range(min(n, 60)):
        s, e = int(cu[i]), int(cu[i + 1])
        if e == s:
            continue
        qq, kk, vv = (x[s:e].transpose(0, 1)[None].float() for x in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=sc,
                                                               enable_gqa=True)[0].transpose(0, 1)
        for name, o in (("order", oa), ("rr", ob)):
            errs[name] = max(errs[name], (o[s:e].float() - ref).abs().max().item())
    print(f"  max |o - fp32 ref| over the first 60 sequences: {errs}")


for args in ((40, 64, False, 4, 104), (40, 64, True, 2, 104), (300, 128, False, 1, 428), (12, 128, True, 4, 140)):
    case(*args)
