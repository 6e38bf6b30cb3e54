"""The Gluon dK/dV kernel's consumer loop in SASS, on any machine (Triton's ptxas and nvdisasm, no GPU): compiles
``attention_sm90_bwd._attention_bwd_dkdv_sm90_kernel`` for sm_90 (D = 128, host K / V descriptors, the module's
dropout switches), prints ptxas's registers and spill bytes, and for every innermost loop with warpgroup MMAs (a
back branch whose range holds HGMMA instructions: one a consumer, twice where a branch splits it) its instruction
count and most frequent opcodes. The seventy-fourth session's probe (HISTORY.md): the dropout's cost in the loop
(1057-1129 instructions against 529-595 without), and its registers, which the time followed (run452-453).

Usage: ``python benchmarks/dev/attention_bwd_sass_loops.py [--variants drop_fused_causal,fused_full,...]
[--out DIR]`` (a variant: ``drop_`` for dropout, ``fused`` or ``dkdv``, ``causal`` or ``full``; ``--out`` keeps the
PTX and SASS there).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import torch


def loops(sass: str) -> list:
    """(instructions, HGMMAs, {opcode: count}) of each loop that holds HGMMA instructions."""
    ins, labels, pending = [], {}, []
    for ln in sass.splitlines():
        m = re.match(r"(\.L_x_\d+):", ln.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", ln)
        if m:
            addr = int(m.group(1), 16)
            for p in pending:
                labels[p] = addr
            pending = []
            ins.append((addr, m.group(2).strip()))
    index = {a: i for i, (a, _) in enumerate(ins)}
    spans = []
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA\s.*?(\.L_x_\d+)", t)
        if m and m.group(1) in labels and labels[m.group(1)] < a:
            body = ins[index[labels[m.group(1)]]:i + 1]
            if any("HGMMA" in x for _, x in body):
                spans.append((index[labels[m.group(1)]], i))
    out = []
    for lo, hi in spans:  # innermost: no other such loop inside
        if any((lo, hi) != (l2, h2) and lo <= l2 and h2 <= hi for l2, h2 in spans):
            continue
        ops = collections.Counter((x.split()[1] if x.startswith("@") else x.split()[0]).split(".")[0]
                                  for _, x in ins[lo:hi + 1])
        out.append((hi + 1 - lo, ops["HGMMA"], dict(ops.most_common(12))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="fused_causal,drop_fused_causal,fused_full,drop_fused_full")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import attention_sm90_gluon_ws as ws
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from pykernels._kernels import attention_sm90_bwd as kb
    from pykernels._kernels.attention_sm90 import MAX_REGS, smem_layouts
    d = 128
    bn, bm, stages = kb.DKDV_CONFIGS[d]
    ql, kl = smem_layouts(bm, bn, d, torch.bfloat16)

    def desc(rows, layout):
        return mangle_type(TensorDescriptor.from_tensor(torch.empty(4096, d, dtype=torch.bfloat16), [rows, d], layout))

    fn = kb._attention_bwd_dkdv_sm90_kernel
    tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "nvdisasm")
    for v in args.variants.split(","):
        drop, causal, fused = v.startswith("drop"), "causal" in v, "fused" in v
        descs = dict(q_desc=desc(bm, ql), do_desc=desc(bm, ql), **{n: desc(bn, kl) for n in ("K", "V", "DK", "DV")},
                     DQACC=(mangle_type(kb._dq_acc_descriptor(torch.zeros(4096, d), bm, d)) if fused
                            else "constexpr"))
        sig = {p.name: (descs[p.name] if p.name in descs else "*i64" if p.name == "Seed"
                        else "*fp32" if p.name in ("LSE", "DELTA") else "i64" if p.name.startswith("stride")
                        else "fp32" if p.name in ("qk_scale", "scale", "drop_inv")
                        else "constexpr" if p.is_constexpr or p.name == "Trace" else "i32") for p in fn.params}
        consts = dict(HEAD_D=d, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages, IS_CAUSAL=causal, FUSED_DQ=fused, LPT=causal,
                      STATS_EARLY=kb.STATS_EARLY and not causal, kv_layout=kl,
                      ds_layout=kb._ds_layout(bn, bm, torch.bfloat16) if fused else kl, num_warps=4, HOST_KV=True,
                      HAS_DROPOUT=drop, Trace=None, DROP_EARLY=kb.DROPOUT_EARLY, DROP_CARRY=kb.DROPOUT_CARRY,
                      DROP_ROT=kb.DROPOUT_ROT, D_COLS=0)
        if not fused:
            consts["DQACC"] = None
        kern = triton.compile(GluonASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, maxnreg=MAX_REGS))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kern.asm["cubin"])
            f.flush()
            sass = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            for ext, text in (("ptx", kern.asm["ptx"]), ("sass", sass)):
                with open(os.path.join(args.out, f"{v}.{ext}"), "w") as f:
                    f.write(text)
        print(f"{v}: {ws._ptxas_report(kern.asm['ptx'])}", flush=True)
        for n, h, ops in loops(sass):
            print(f"  loop of {n} instructions, {h} HGMMA: {ops}", flush=True)


if __name__ == "__main__":
    main()
