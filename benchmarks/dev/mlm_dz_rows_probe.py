"""Does the dz epilogue's dependent gather cost time? The sm_90 Gluon kernel's dz epilogue reads each row's
target, lse and upstream gradient through the compacted row index (``rows[offs_m]``, then three loads at that
position: two dependent L2 round trips before the first exponential). This probe builds a variant of
``kernels/masked_lm_loss_sm90.py`` whose epilogue reads them directly at the compacted row (one round trip;
``rows[i]`` replaced by ``i``, the inputs compacted by torch beforehand, as a gather kernel could write them
once per backward) and times one dz chunk of both, checking that dz is bitwise the same.

Usage (GPU): ``python benchmarks/dev/mlm_dz_rows_probe.py [--cases bert,gpt2]``"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CASES = {"bert": (16384, 2446, 768, 30522), "gpt2": (8192, 8192, 768, 50257)}
CHUNK = 7680


def direct_variant():
    """The package module with the row indirection of ``_dz_rows`` removed, imported from a temporary file
    (Gluon's JIT reads the source)."""
    from pykernels._kernels import masked_lm_loss_sm90 as g
    src = open(g.__file__).read()
    old = "rows = gl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(gl.int64)"
    assert old in src
    src = src.replace(old, "rows = offs_m.to(gl.int64)")
    src = src.replace("from . import _launch, _tuning", "from pykernels._kernels import _launch, _tuning")
    src = src.replace("from .masked_lm_loss import _tile_launcher",
                      "from pykernels._kernels.masked_lm_loss import _tile_launcher")
    path = os.path.join(tempfile.mkdtemp(), "mlm_sm90_direct.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("mlm_sm90_direct", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ev_us(fn, calls=20):
    from mlm_kernel_probe import cuda_events
    ts = [e.device_time_total for e in cuda_events(fn, calls) if "_logits_" in e.name]
    return statistics.median(ts) if ts else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="bert,gpt2")
    args = ap.parse_args()
    from mlm_kernel_probe import make

    from pykernels._kernels import masked_lm_loss as kmod
    from pykernels._kernels import masked_lm_loss_sm90 as g
    d_mod = direct_variant()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    for name in args.cases.split(","):
        n, m, h, v = CASES[name]
        hidden, weight, target = (t.detach() for t in make(n, m, h, v))
        rows, count, _, _ = kmod.compact(target, -100)
        hc = kmod.gather_rows(hidden, rows, count)
        _, lse = kmod.masked_lm_loss_fwd(hidden, weight, target, None, rows, count, label_smoothing=0.0)
        gl_ = torch.rand(n, device="cuda") + 0.5
        r = rows[:m].long()
        # compacted per-row inputs (past m: what the kernel masks anyway)
        tgt_c, lse_c, g_c = target.clone(), lse.clone(), gl_.clone()
        tgt_c[:m], lse_c[:m], g_c[:m] = target[r], lse[r], gl_[r]
        vc = min(CHUNK, v)
        flop = 2.0 * m * vc * h
        print(f"\n== {name}: N {n}, M {m}, H {h}, V {v}, a {vc}-column chunk")
        for v_off in (0, v - vc):
            outs, times = [], []
            for label, mod, tg, ls, gg in (("gather", g, target, lse, gl_), ("direct", d_mod, tgt_c, lse_c, g_c)):
                d = torch.full((m, vc), float("nan"), device="cuda", dtype=torch.bfloat16)
                launch = mod.logits(hc, weight, None, tg, rows, count, ls, gg, None, n=n, n_rows=m,
                                    label_smoothing=0.0, dz=True)
                launch(d, v_off, vc)
                us = ev_us(lambda: launch(d, v_off, vc))
                outs.append(d)
                times.append(us)
            for _ in range(2):  # again, alternating, for the card's drift
                for i, (mod, tg, ls, gg) in enumerate(((g, target, lse, gl_), (d_mod, tgt_c, lse_c, g_c))):
                    launch = mod.logits(hc, weight, None, tg, rows, count, ls, gg, None, n=n, n_rows=m,
                                        label_smoothing=0.0, dz=True)
                    times.append(ev_us(lambda: launch(outs[i], v_off, vc)))
            same = torch.equal(outs[0], outs[1])
            tg_, td_ = statistics.median(times[0::2]), statistics.median(times[1::2])
            print(f"  v_off={v_off}: gather {tg_:6.1f} us ({flop / tg_ / 1e6:4.0f} TFLOP/s), direct {td_:6.1f} us "
                  f"({flop / td_ / 1e6:4.0f} TFLOP/s): {tg_ / td_:.3f}x; dz bitwise equal: {same}; runs "
                  + " ".join(f"{t:.1f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
