"""Probe of the Gluon attention backward for Hopper (``kernels/attention_sm90_bwd.py``): each Gluon kernel
(dK/dV, dQ) against the Triton backward's gradients and its time next to the Triton backward, per shape
and config; ``--compile-only`` compiles every config for sm_90 on any machine (Triton's ptxas: registers,
spills, shared memory; ``tests/test_gluon_sm90_compile.py`` runs it).

History (H100, 2026-11-26, ``benchmarks/results/attention_bwd_sm90_probe_*_run39..49.txt``). The dK/dV
kernel was first written here and ran first in run39: B2 H16 S8192 D128, its 4 GEMMs at 646 / 511
TFLOP/s full / causal with 64-query blocks (3.41 / 2.15 ms), 536 / 450 with the spill-free 32-query
blocks; the whole Triton backward took 6.53 / 4.06 ms. run41: the first Gluon dQ lost to Triton's; run42:
dQ fused into the dK/dV kernel with fp32 atomics, 9.8 vs 6.0 ms (run53: with bulk TMA reductions, 6.09 vs
5.92 ms); run44: the dQ kernel with ping-pong and
four stages beat Triton's; run46: causal CTAs longest first (dK/dV 2.13 -> 1.89 ms); run47-48: host K/V
descriptors in the dK/dV kernel, slower (reverted); run49: the whole backward 5.56 / 3.19 ms (Triton's
6.86 / 4.13). Each "whole backward" line sets ``PYKERNELS_ATTN_SM90_BWD`` (a value set is taken at D = 64
too, where the Gluon kernels lose); at the small shapes those lines are host-bound and noisy.

Usage (GPU): ``python benchmarks/dev/attention_bwd_sm90_gluon.py``.
"""
from __future__ import annotations

import itertools
import os
import sys

import torch

from pykernels._kernels import attention_sm90_bwd as kb

# (head dim) -> alternative configs the probe times next to the defaults
DKDV_ALT = {64: [], 128: []}
DQ_ALT = {64: [(64, 64, 3)], 128: [(64, 64, 3), (64, 64, 5)]}
FUSED_ALT = {64: [], 128: []}  # (64, 64, 3) lost 5-15% (run55)


def compile_only() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import attention_sm90_gluon_ws as ws
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from pykernels._kernels.attention_sm90 import MAX_REGS, smem_layouts

    def sig_of(fn, descs):
        sig = {}
        for p in fn.params:
            n = p.name
            sig[n] = (descs[n] if n in descs else "*i64" if n == "Seed" else "*bf16" if n in ("K", "V", "DK", "DV", "DQ", "O")
                      else "*fp32" if n in ("LSE", "DELTA") else "i64" if n.startswith("stride")
                      else "fp32" if n in ("qk_scale", "scale", "drop_inv") else "constexpr" if p.is_constexpr or n == "Trace"
                      else "i32")
        return sig

    def desc(rows, d, layout):
        return mangle_type(TensorDescriptor.from_tensor(torch.empty(4096, d, dtype=torch.bfloat16), [rows, d], layout))

    for d in (64, 128):
        for cfg in [kb.DKDV_CONFIGS[d]] + DKDV_ALT[d]:
            bn, bm, stages = cfg
            ql, kl = smem_layouts(bm, bn, d, torch.bfloat16)
            for causal, fused, host_kv in itertools.product((False, True), repeat=3):
                fn = kb._attention_bwd_dkdv_sm90_kernel
                dqacc = (mangle_type(kb._dq_acc_descriptor(torch.zeros(4096, d), bm, d)) if fused
                         else "constexpr")
                descs = dict(q_desc=desc(bm, d, ql), do_desc=desc(bm, d, ql), DQACC=dqacc)
                if host_kv:  # (K, V, dK, dV through host descriptors: kb.HOST_KV)
                    descs.update({n: desc(bn, d, kl) for n in ("K", "V", "DK", "DV")})
                sig = sig_of(fn, descs)
                dsl = kb._ds_layout(bn, bm, torch.bfloat16) if fused else kl
                consts = dict(HEAD_D=d, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages, IS_CAUSAL=causal, FUSED_DQ=fused,
                              LPT=causal, STATS_EARLY=kb.STATS_EARLY and not causal,
                              kv_layout=kl, ds_layout=dsl, num_warps=4, HOST_KV=host_kv, D_COLS=0)
                consts["Trace"] = None
                if not fused:
                    consts["DQACC"] = None
                print(f"bwd-{'fused' if fused else 'dkdv'} D{d} cfg{cfg} {'causal' if causal else 'full'}"
                      f"{' host-kv' if host_kv else ''}: "
                      f"{ws.compile_report(fn, sig, consts, dict(num_warps=4, maxnreg=MAX_REGS))}", flush=True)
        if d == 128:  # D = 96 on these tiles (``attention_sm90.TILE_D``): K / V / dK / dV descriptors made on the device
            bn, bm, stages = kb.DKDV_CONFIGS[d]  # 96 columns wide (D_COLS; the host's are the D = 128 kernel's code)
            ql, kl = smem_layouts(bm, bn, d, torch.bfloat16)
            for causal, fused in itertools.product((False, True), repeat=2):
                fn = kb._attention_bwd_dkdv_sm90_kernel
                dqacc = mangle_type(kb._dq_acc_descriptor(torch.zeros(4096, d), bm, d)) if fused else "constexpr"
                sig = sig_of(fn, dict(q_desc=desc(bm, d, ql), do_desc=desc(bm, d, ql), DQACC=dqacc))
                consts = dict(HEAD_D=d, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages, IS_CAUSAL=causal, FUSED_DQ=fused,
                              LPT=causal, STATS_EARLY=kb.STATS_EARLY and not causal, kv_layout=kl,
                              ds_layout=kb._ds_layout(bn, bm, torch.bfloat16) if fused else kl, num_warps=4,
                              HOST_KV=False, D_COLS=96, Trace=None)
                if not fused:
                    consts["DQACC"] = None
                print(f"bwd-{'fused' if fused else 'dkdv'}-d96 D{d} cfg{(bn, bm, stages)} "
                      f"{'causal' if causal else 'full'}: "
                      f"{ws.compile_report(fn, sig, consts, dict(num_warps=4, maxnreg=MAX_REGS))}", flush=True)
        if d == 128:  # with dropout (HAS_DROPOUT: the keep mask drawn in the consumers), fused or not, both layouts
            bn, bm, stages = kb.DKDV_CONFIGS[d]
            ql, kl = smem_layouts(bm, bn, d, torch.bfloat16)
            for causal, fused, host_kv in itertools.product((False, True), repeat=3):
                fn = kb._attention_bwd_dkdv_sm90_kernel
                descs = dict(q_desc=desc(bm, d, ql), do_desc=desc(bm, d, ql), Seed="*i64",
                             DQACC=(mangle_type(kb._dq_acc_descriptor(torch.zeros(4096, d), bm, d)) if fused
                                    else "constexpr"))
                if host_kv:
                    descs.update({n: desc(bn, d, kl) for n in ("K", "V", "DK", "DV")})
                sig = sig_of(fn, descs)
                consts = dict(HEAD_D=d, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages, IS_CAUSAL=causal, FUSED_DQ=fused,
                              LPT=causal, STATS_EARLY=kb.STATS_EARLY and not causal, kv_layout=kl,
                              ds_layout=kb._ds_layout(bn, bm, torch.bfloat16) if fused else kl, num_warps=4,
                              HOST_KV=host_kv, HAS_DROPOUT=True, Trace=None, DROP_EARLY=kb.DROPOUT_EARLY,
                              DROP_CARRY=kb.DROPOUT_CARRY, DROP_ROT=kb.DROPOUT_ROT, D_COLS=0)
                if not fused:
                    consts["DQACC"] = None
                print(f"bwd-drop-{'fused' if fused else 'dkdv'} D{d} cfg{(bn, bm, stages)} "
                      f"{'causal' if causal else 'full'}{' host-kv' if host_kv else ''}: "
                      f"{ws.compile_report(fn, sig, consts, dict(num_warps=4, maxnreg=MAX_REGS))}", flush=True)
        if d == 128:  # the development timeline's variant (benchmarks/dev/attention_bwd_trace.py), fused and causal
            bn, bm, stages = kb.DKDV_CONFIGS[d]
            ql, kl = smem_layouts(bm, bn, d, torch.bfloat16)
            fn = kb._attention_bwd_dkdv_sm90_kernel
            sig = sig_of(fn, dict(q_desc=desc(bm, d, ql), do_desc=desc(bm, d, ql), Trace="*i64",
                                  DQACC=mangle_type(kb._dq_acc_descriptor(torch.zeros(4096, d), bm, d)),
                                  **{n: desc(bn, d, kl) for n in ("K", "V", "DK", "DV")}))
            consts = dict(HEAD_D=d, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages, IS_CAUSAL=True, FUSED_DQ=True, LPT=True,
                          STATS_EARLY=False, kv_layout=kl, ds_layout=kb._ds_layout(bn, bm, torch.bfloat16),
                          num_warps=4, TRACE=True, HOST_KV=True, D_COLS=0)
            print(f"bwd-trace D{d} causal: {ws.compile_report(fn, sig, consts, dict(num_warps=4, maxnreg=MAX_REGS))}",
                  flush=True)
        for cfg in [kb.DQ_CONFIGS[d]] + DQ_ALT[d]:
            bm, bn, stages = cfg
            ql, kl = smem_layouts(bm, bn, d, torch.bfloat16)
            for causal in (False, True):
                fn = kb._attention_bwd_dq_sm90_kernel
                qd, kd = desc(bm, d, ql), desc(bn, d, kl)
                sig = sig_of(fn, dict(q_desc=qd, do_desc=qd, k_desc=kd, v_desc=kd, dq_desc=qd))
                consts = dict(HEAD_D=d, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, IS_CAUSAL=causal, LPT=causal,
                              COMPUTE_DELTA=True, q_layout=ql, kv_layout=kl, num_warps=4)  # (the package's default)
                print(f"bwd-dq D{d} cfg{cfg} {'causal' if causal else 'full'}: "
                      f"{ws.compile_report(fn, sig, consts, dict(num_warps=4, maxnreg=MAX_REGS))}", flush=True)


def fused_sweep() -> None:
    """``--fused-sweep``: the whole backward at D = 128, the pair (dK/dV and dQ kernels) and the fused kernel,
    next to cuDNN's backward, do_bench, per shape; causal with each ``LPT_L2_BYTES`` (the head groups of the
    longest-first order; 0 = all heads at once, the order before run88).
    History: run87, the fused kernel with its CTAs' query loops started at spread-out blocks (fewer CTAs
    reducing into the same dQ rows at once) lost 1-7% (it loses the CTAs' shared Q / dO reads in L2), two dQ
    staging tiles per warpgroup -16..+1%; not kept."""
    from triton.testing import do_bench

    from pykernels._kernels import attention as tri
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    shapes = [(16, 16, 16, 1024, False), (8, 16, 16, 2048, False), (4, 16, 16, 4096, False),
              (2, 16, 16, 8192, False), (4, 32, 8, 4096, False), (16, 16, 16, 1024, True),
              (8, 16, 16, 2048, True), (4, 16, 16, 4096, True), (2, 16, 16, 8192, True), (4, 32, 8, 4096, True)]
    default = kb.LPT_L2_BYTES
    for b, h, hkv, s_, causal in shapes:
        d = 128
        q = torch.randn(b, h, s_, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, s_, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn_like(q)
        sc = d ** -0.5
        o, lse = tri.attention_fwd(q, k, v, None, causal=causal, scale=sc, dropout_p=0.0, seed=0)
        flops = 5 * 2 * b * h * s_ * s_ * d / (2 if causal else 1)
        name = f"B{b} H{h}/{hkv} S{s_} D{d} {'causal' if causal else 'full'}"

        def bwd():
            return tri.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc, dropout_p=0.0, seed=0)

        kk, vv = (t.repeat_interleave(h // hkv, 1).detach().requires_grad_() for t in (k, v))
        qq = q.detach().requires_grad_()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=sc)
            cudnn = do_bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
        line = [f"{name}: cuDNN {cudnn:.3f} ms ({flops / cudnn / 1e9:.0f} TFLOP/s)"]
        ref = None
        for budget in ((0, 12 << 20, 24 << 20, 48 << 20) if causal else (default,)):
            kb.LPT_L2_BYTES = budget
            for which in ("dkdv,dq", "fused"):
                os.environ["PYKERNELS_ATTN_SM90_BWD"] = which
                try:
                    got = bwd()
                    ref = ref or got
                    err = max((x.float() - y.float()).abs().max().item() for x, y in zip(got, ref))
                    ms = do_bench(bwd)
                    line.append(f"{which} L2 {budget >> 20} MiB {ms:.3f} ({flops / ms / 1e9:.0f}, {cudnn / ms:.3f}x "
                                f"cuDNN, err {err:.1e})")
                except Exception as e:  # report and go on: this is a probe
                    line.append(f"{which} L2 {budget >> 20} ERROR {type(e).__name__}: {str(e)[:200]}")
        kb.LPT_L2_BYTES = default
        print("; ".join(line), flush=True)
        os.environ.pop("PYKERNELS_ATTN_SM90_BWD")


def main() -> None:
    if "--compile-only" in sys.argv:
        compile_only()
        return
    if "--fused-sweep" in sys.argv:
        fused_sweep()
        return
    from triton.testing import do_bench

    from pykernels._kernels import attention as tri
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    quick = "--quick" in sys.argv  # the long D = 128 shapes, the default pair against the fused kernel only
    shapes = [(32, 12, 12, 512, 64, False), (8, 12, 12, 1024, 64, True), (4, 16, 16, 4096, 128, True),
              (2, 16, 16, 8192, 128, False), (2, 16, 16, 8192, 128, True), (2, 8, 2, 1000, 128, True)]
    for b, h, hkv, s_, d, causal in (shapes[2:5] if quick else shapes):
        try:
            q = torch.randn(b, h, s_, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, hkv, s_, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            do = torch.randn_like(q)
            sc = d ** -0.5
            o, lse = tri.attention_fwd(q, k, v, None, causal=causal, scale=sc, dropout_p=0.0, seed=0)
            delta = (o.float() * do.float()).sum(-1).contiguous()
            gemm = 2 * b * h * s_ * s_ * d / (2 if causal else 1)  # one of the backward's GEMMs

            def bwd():
                return tri.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc, dropout_p=0.0, seed=0)

            times = {}
            for which in ("", "dkdv,dq", "fused") if quick else ("", "dkdv", "dq", "dkdv,dq", "fused"):  # which kernels are Gluon's; the rest Triton's
                os.environ["PYKERNELS_ATTN_SM90_BWD"] = which
                got = bwd()
                if not which:
                    dq_t, dk_t, dv_t = got
                err = max((x.float() - y.float()).abs().max().item() for x, y in zip(got, (dq_t, dk_t, dv_t)))
                times[which or "triton"] = ms = do_bench(bwd)
                print(f"B{b} H{h}/{hkv} S{s_} D{d} {'causal' if causal else 'full'} whole backward, Gluon "
                      f"[{which}]: {ms:.3f} ms ({5 * gemm / ms / 1e9:.0f} TFLOP/s, 5-GEMM count); max |vs Triton| "
                      f"{err:.2e}", flush=True)
            if causal and not quick:  # the causal CTA order: longest first across heads (default) against by head
                os.environ["PYKERNELS_ATTN_SM90_BWD"] = "dkdv,dq"
                for lpt in (False, True):
                    kb.CAUSAL_LPT = lpt
                    ms = do_bench(bwd)
                    print(f"    causal order {'longest first' if lpt else 'by head'}: whole backward {ms:.3f} ms "
                          f"({5 * gemm / ms / 1e9:.0f} TFLOP/s)", flush=True)
            if not quick:
                print(f"    so Triton dK/dV ~{times['triton'] - times['dq']:.3f} ms, Triton dQ "
                      f"~{times['triton'] - times['dkdv']:.3f} ms (+ preprocess)", flush=True)
            dk, dv, dq = torch.empty_like(k), torch.empty_like(v), torch.empty_like(q)
            for cfg in [kb.DKDV_CONFIGS[d]] + DKDV_ALT[d]:
                def run(cfg=cfg):
                    assert kb.attention_bwd_dkdv_sm90(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=sc,
                                                      config=cfg)
                run()
                err = max((dk.float() - dk_t.float()).abs().max().item(), (dv.float() - dv_t.float()).abs().max().item())
                ms = do_bench(run)
                print(f"    dK/dV {cfg}: max |err| {err:.2e} (max |dk_t| {dk_t.float().abs().max().item():.2e}); "
                      f"{ms:.3f} ms {4 * gemm / ms / 1e9:.0f} TFLOP/s", flush=True)
            for cfg in [kb.DKDV_CONFIGS[d]] + FUSED_ALT[d]:
                def run_fused(cfg=cfg):
                    assert kb.attention_bwd_dkdv_sm90(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=sc,
                                                      config=cfg, dq=dq)
                run_fused()
                err = max((x.float() - y.float()).abs().max().item() for x, y in ((dq, dq_t), (dk, dk_t), (dv, dv_t)))
                ms = do_bench(run_fused)
                print(f"    fused dK/dV/dQ {cfg}: max |err| {err:.2e}; {ms:.3f} ms {5 * gemm / ms / 1e9:.0f} TFLOP/s",
                      flush=True)
            for cfg in [] if quick else [kb.DQ_CONFIGS[d]] + DQ_ALT[d]:
                def run(cfg=cfg):
                    assert kb.attention_bwd_dq_sm90(do, q, k, v, lse, delta, dq, causal=causal, scale=sc, config=cfg)
                run()
                err = (dq.float() - dq_t.float()).abs().max().item()
                ms = do_bench(run)
                print(f"    dQ {cfg}: max |err| {err:.2e} (max |dq_t| {dq_t.float().abs().max().item():.2e}); "
                      f"{ms:.3f} ms {3 * gemm / ms / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as e:  # report and go on: this is a probe
            print(f"B{b} H{h} S{s_} D{d}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
