"""The masked-LM loss's warp-specialised Gluon logits kernel (``kernels/masked_lm_loss_sm90.py``) against the
Triton TMA kernel (``_logits_tma_kernel``) it replaces on sm_90.

1. ``kernels``: per case, the forward's partials (merged to each row's base-2 logsumexp) and one backward chunk's
   dz (``CHUNK`` columns) from both kernels, compared with each other, and each kernel's device time (torch.profiler,
   median of 10 launches) for a few Gluon tile configs.
2. ``ab``: kernel time of a public forward+backward (torch.profiler, as ``mlm_kernel_probe.kernel_table``) with the Gluon kernel off / on (``SM90_FWD`` / ``SM90_DZ``) and the wave-sized chunks (``WAVE_CHUNKS``)
   alternating, two rounds; loss and gradients against all off.

Usage (GPU): ``python benchmarks/dev/mlm_logits_sm90.py [--cases bert,bert_large,gpt2] [--parts kernels,ab]``;
``--compile-only`` anywhere (sm_90 with Triton's ptxas: shared memory, registers, spills).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CASES = {"bert": (16384, 2446, 768, 30522), "bert_large": (16384, 2377, 1024, 30522), "gpt2": (8192, 8192, 768, 50257),
         "bert_bias": (16384, 2446, 768, 30522)}  # (ab: with the LM head's bias)
CHUNK = 7680
# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES) tried per epilogue; the first is the module's default
FWD_CONFIGS = [(128, 128, 64, 4), (128, 128, 64, 6), (128, 128, 128, 3)]
DZ_CONFIGS = [(128, 128, 64, 4), (128, 128, 64, 5)]


def compile_only() -> None:
    import attention_sm90_gluon_ws as ws
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from pykernels._kernels import masked_lm_loss_sm90 as g
    fn = g._logits_sm90_kernel
    consts_names = {"NUM_PROGRAMS", "DZ", "HAS_BIAS", "SMOOTH", "COL_MASK", "BLOCK_M", "BLOCK_N", "BLOCK_K",
                    "STAGES", "num_warps"}
    sig = {}
    for p in fn.params:
        n = p.name
        sig[n] = ("*bf16" if n == "b_ptr" else "*i64" if n == "tgt_ptr"
                  else "*i32" if n in ("rows_ptr", "count_ptr") else "*fp32" if n.endswith("_ptr")
                  else "fp32" if n == "smooth_eps" else "constexpr" if n in consts_names else "i32")
    t = torch.empty(4096, 768, dtype=torch.bfloat16)  # (a CPU stand-in: only the descriptors' types matter)
    for dz in (False, True):
        cfg = g.DZ_CONFIG if dz else g.FWD_CONFIG
        for bias, smooth in ((False, False), (True, True)):
            al, wl, ol = g.smem_layouts(cfg, torch.bfloat16)
            bm, bn, bk, stages = cfg
            ad, wd, od = (mangle_type(TensorDescriptor.from_tensor(t, blk, lay))
                          for blk, lay in (([bm, bk], al), ([bn, bk], wl), ([bm, bn], ol)))
            sig.update(a_desc=ad, w_desc=wd, out_desc=od if dz else ad)
            # (dz with a bias and smoothing: the last chunk's column mask too, the most live state)
            consts = dict(NUM_PROGRAMS=132, DZ=dz, HAS_BIAS=bias, SMOOTH=smooth, COL_MASK=dz and bias, BLOCK_M=bm,
                          BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, num_warps=4)
            report = ws.compile_report(fn, sig, consts, dict(num_warps=4, maxnreg=g.MAX_REGS))
            print(f"mlm-sm90 {'dz' if dz else 'fwd'} cfg{cfg} bias={bias} smooth={smooth}: {report}", flush=True)


def ev_us(fn, calls=10):
    """Median device time of the logits kernel over ``calls`` back-to-back launches (torch.profiler: CUDA
    events around one launch on an idle GPU time the host's launch too)."""
    from mlm_kernel_probe import cuda_events
    ts = [e.device_time_total for e in cuda_events(fn, calls) if "_logits_" in e.name]
    return statistics.median(ts) if ts else float("nan")


def kernels(name, n, m, h, v):
    from pykernels._kernels import masked_lm_loss as kmod
    from pykernels._kernels import masked_lm_loss_sm90 as g
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = (torch.randn(v, h, device="cuda", generator=gen) * h**-0.5).to(torch.bfloat16)
    bias = (torch.randn(v, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    target = torch.full((n,), -100, device="cuda")
    pos = torch.randperm(n, device="cuda", generator=gen)[:m]
    target[pos] = torch.randint(0, v, (m,), device="cuda", generator=gen)
    rows, count, loss0, lse0 = kmod.compact(target, -100)
    hc = kmod.gather_rows(hidden, rows, count)
    print(f"\n== {name}: N {n}, M {m}, H {h}, V {v}")
    for with_bias in (False, True):
        b = bias if with_bias else None
        flop = 2.0 * m * v * h
        # forward partials -> each valid row's base-2 logsumexp
        def lse2(parts):  # (the partials are indexed by compacted row)
            pm, ps = parts[0][:, :m], parts[1][:, :m]
            mx = pm.max(0).values
            return mx + torch.log2((ps * torch.exp2(pm - mx)).sum(0))

        def parts_for(bn):
            split = -(-v // bn)
            p = [torch.full((split, n), float("nan"), device="cuda") for _ in range(2)]
            return p + [p[0], p[0]]
        lse = torch.zeros(n, device="cuda")
        ref_parts = parts_for(kmod._tma_cfg(kmod.TMA_FWD_CONFIG)[1])
        old = kmod.SM90_FWD, kmod.SM90_DZ
        kmod.SM90_FWD = kmod.SM90_DZ = False
        launch_t = kmod._logits_tma(hc, weight, b, target, rows, count, lse, lse, ref_parts, n=n, n_rows=-1,
                                    label_smoothing=0.0, cfg=kmod.TMA_FWD_CONFIG, dz=False, zt=False)
        launch_t(None, 0, v)
        ref = lse2(ref_parts)
        us_t = ev_us(lambda: launch_t(None, 0, v))
        print(f"  fwd bias={with_bias}: Triton {kmod.TMA_FWD_CONFIG}: {us_t:7.1f} us {flop / us_t / 1e6:5.0f} TFLOP/s")
        for cfg in FWD_CONFIGS:
            try:
                parts = parts_for(cfg[1])
                launch = g.logits(hc, weight, b, target, rows, count, lse, lse, parts, n=n, n_rows=-1,
                                  label_smoothing=0.0, dz=False, cfg=cfg)
                launch(None, 0, v)
                err = (lse2(parts) - ref).abs().max().item()
                us = ev_us(lambda: launch(None, 0, v))
                print(f"  fwd bias={with_bias}: Gluon {cfg}: {us:7.1f} us {flop / us / 1e6:5.0f} TFLOP/s "
                      f"({us_t / us:.3f}x); max |lse2 - Triton's| {err:.2e}", flush=True)
            except Exception as e:  # a probe: report and go on
                print(f"  fwd {cfg}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
        # one backward chunk's dz (the sized backward's call: host count m, lse and the upstream gradient)
        _, lse_full = kmod.masked_lm_loss_fwd(hidden, weight, target, b, rows, count, label_smoothing=0.0)
        gl_ = torch.rand(n, device="cuda") + 0.5
        vc = min(CHUNK, v)
        flop_c = 2.0 * m * vc * h
        for v_off in (0, v - vc):  # the first chunk and the last (columns up to V)
            d_ref = torch.full((m, vc), float("nan"), device="cuda", dtype=torch.bfloat16)
            launch_t = kmod._logits_tma(hc, weight, b, target, rows, count, lse_full, gl_, None, n=n, n_rows=m,
                                        label_smoothing=0.0, cfg=kmod.TMA_DZ_CONFIG, dz=True)
            launch_t(d_ref, v_off, vc)
            us_t = ev_us(lambda: launch_t(d_ref, v_off, vc))
            print(f"  dz bias={with_bias} v_off={v_off}: Triton {kmod.TMA_DZ_CONFIG}: {us_t:7.1f} us "
                  f"{flop_c / us_t / 1e6:5.0f} TFLOP/s")
            for cfg in DZ_CONFIGS:
                try:
                    d = torch.full((m, vc), float("nan"), device="cuda", dtype=torch.bfloat16)
                    launch = g.logits(hc, weight, b, target, rows, count, lse_full, gl_, None, n=n, n_rows=m,
                                      label_smoothing=0.0, dz=True, cfg=cfg)
                    launch(d, v_off, vc)
                    diff = (d.float() - d_ref.float()).abs()
                    bad = int(torch.isnan(d).sum().item())
                    us = ev_us(lambda: launch(d, v_off, vc))
                    print(f"  dz bias={with_bias} v_off={v_off}: Gluon {cfg}: {us:7.1f} us "
                          f"{flop_c / us / 1e6:5.0f} TFLOP/s ({us_t / us:.3f}x); max |dz - Triton's| "
                          f"{diff.nan_to_num(float('inf')).max().item():.2e}, differing "
                          f"{int((diff != 0).sum().item())} of {d.numel()}, NaN {bad}", flush=True)
                except Exception as e:  # a probe: report and go on
                    print(f"  dz {cfg}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
        kmod.SM90_FWD, kmod.SM90_DZ = old


def ab(name, n, m, h, v):
    import pykernels
    from mlm_kernel_probe import cuda_events, kernel_rows, make
    from pykernels._kernels import masked_lm_loss as kmod
    hidden, weight, target = make(n, m, h, v)
    dense = name == "gpt2"
    bias = (torch.randn(v, device="cuda") * 0.1).to(hidden.dtype).requires_grad_(True) if "bias" in name else None

    def run():
        hidden.grad = weight.grad = None
        loss = pykernels.masked_lm_loss(hidden, weight, target, bias=bias, dense=dense)
        loss.backward()
        return loss.detach(), hidden.grad, weight.grad

    def kernel_us():
        rows = kernel_rows(cuda_events(run))
        logits = {k: t for k, (t, _) in rows.items() if "_logits_" in k}
        return sum(t for t, _ in rows.values()), logits

    res = {}
    print(f"\n== {name}: public forward+backward, kernel time (torch.profiler, 5 calls)")
    configs = [(False, False, False), (True, True, False), (True, True, True)] * 2
    if bias is not None:
        configs += [(False, True, True)]
    for fwd, dz, waves in configs:
        kmod.SM90_FWD, kmod.SM90_DZ, kmod.WAVE_CHUNKS = fwd, dz, waves
        us, logits = kernel_us()
        hidden.grad = weight.grad = None
        if bias is not None:
            bias.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = run()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        res.setdefault((fwd, dz, waves), out)
        parts = ", ".join(f"{k} {t:.1f}" for k, t in sorted(logits.items()))
        print(f"  SM90_FWD={fwd!s:5} SM90_DZ={dz!s:5} WAVE_CHUNKS={waves!s:5}: {us:8.1f} us (logits kernels: "
              f"{parts}); peak {peak:.1f} MiB above the inputs (gradients included)", flush=True)
    base = res[(False, False, False)]
    for key, out in res.items():
        if key == (False, False, False):
            continue
        print(f"  {key}: loss {out[0].item():.6f} vs {base[0].item():.6f}; max |dh| diff "
              f"{(out[1] - base[1]).abs().max().item():.3e}, max |dw| diff {(out[2] - base[2]).abs().max().item():.3e}")
    kmod.SM90_FWD = kmod.SM90_DZ = kmod.WAVE_CHUNKS = True


def main() -> None:
    if "--compile-only" in sys.argv:
        compile_only()
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="bert,bert_large,gpt2")
    ap.add_argument("--parts", default="kernels,ab")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for part in args.parts.split(","):
        for name in args.cases.split(","):
            {"kernels": kernels, "ab": ab}[part](name, *CASES[name])


if __name__ == "__main__":
    main()
