"""Compile the Triton dQ kernel (``kernels/attention.py``'s ``_attention_bwd_dq_kernel``) for sm_90 on any machine
(Triton's own ptxas) at D = Dv = 192, on the 256-wide padded tile and on the column blocks 128 + 64 (``DQ_SPLIT``,
``_dq_inner``'s D_A), at the D = 256 tier's configs: shared memory, registers and spills, wgmma shapes.

Why. The autotuner's D = 256 tier configs spill (the whole kernel's dQ accumulator, Q and dO tiles 256 wide); the
split's tiles are 192 wide, so it should spill less and issue a quarter fewer MMAs. The 83rd session's numbers
(128 x 32 / 8 warps, the tier's first config: 1828 against 3016 bytes spilled, 120 against 160 KiB shared) came from
this script; H200 run494 timed the split at 1.09-1.12x on the whole D = 192 backward.

Usage: ``TRITON_INTERPRET=0 python benchmarks/dev/attention_dq_split_compile.py [--first]`` (``--first``: the tier's
first config only, as ``tests/test_gluon_sm90_compile.py`` runs it)
"""
from __future__ import annotations

import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_sm90_gluon_ws import _ptxas_report, _wgmma_shapes  # noqa: E402

from pykernels._kernels import attention as ka  # noqa: E402

POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "DQ": "*bf16", "O": "*bf16", "LSE": "*fp32",
            "Delta": "*fp32", "Mask": "*i8", "KeepBuf": "*i8", "KvRange": "*i32", "CuQ": "*i32", "CuK": "*i32",
            "Seed": "*i32"}


def main() -> None:
    fn = ka._attention_bwd_dq_kernel
    while not hasattr(fn, "params"):  # (through the autotuner's wrapper to the JITFunction)
        fn = fn.fn
    for causal in (False, True):
        for bm, bn, warps, stages in ka._TABLE["dq"][256][:1 if "--first" in sys.argv else None]:
            for d_a in (0, ka.DQ_SPLIT_D[192]):
                consts = dict(D=192, DV=192, BLOCK_D=256, BLOCK_DV=256, EVEN_D=False, IS_CAUSAL=causal, MASK_KIND=0,
                              HAS_KV_RANGE=False, HAS_DROPOUT=False, IS_VARLEN=False, PRECISION="ieee", IDX64=False,
                              COMPUTE_DELTA=True, PTX_DROPOUT=False, KEEP_BUF=0, BLOCK_M=bm, BLOCK_N=bn, D_A=d_a)
                sig = {p.name: "constexpr" if p.is_constexpr or p.name in consts else POINTERS.get(p.name) or (
                    "i64" if p.name.startswith("stride") else "fp32" if p.name in ("qk_scale", "sm_scale", "dropout_p")
                    else "i32") for p in fn.params}
                label = f"dq D192 {'split 128+64' if d_a else 'padded 256'} {bm}x{bn}/w{warps}/s{stages} " \
                        f"{'causal' if causal else 'full'}"
                try:
                    kern = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                                          options=dict(num_warps=warps, num_stages=stages))
                except Exception as e:  # noqa: BLE001 - a probe: report and go on
                    print(f"{label}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                ptx = kern.asm["ptx"]
                print(f"{label}: shared {kern.metadata.shared} B; {_ptxas_report(ptx)}; wgmma {_wgmma_shapes(ptx)}",
                      flush=True)


if __name__ == "__main__":
    main()
