"""The Triton attention kernels as the JIT compiles them for sm_90, on any machine (Triton's ptxas, no GPU):
``attention.attention_fwd``'s (the Triton forward kernel) and ``attention.attention_bwd``'s launches are captured on
CPU tensors (with the JIT's own argument specialisation: 16-byte aligned pointers and strides and lengths divisible by
16 marked so), and each kernel is compiled with every config of its tables for the case, printing ptxas's registers
and spill bytes, the shared memory, the inline PTX dropout's layouts (the TTGIR of
each ``elementwise_inline_asm``: it must be an ``nvidia_mma`` accumulator, whose register and lane order the PTX
assumes) and the innermost loop's SASS instruction count. The seventy-fifth session's probe for the dQ kernel's quad
keep bits (``attention.PTX_DROPOUT``).

Usage: ``python benchmarks/dev/attention_triton_bwd_codegen.py [--cases bert,gpt2] [--p 0.1] [--ptx 1] [--out DIR]
[--stored] [--kernels fwd,dq,dkdv]``. The seventy-eighth session's screen of the D = 256 tiles (``d256_causal``,
``d256_full``).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch

CASES = {"bert": (2, 2, 512, 64, False), "gpt2": (2, 2, 1024, 64, True), "d128_causal": (2, 2, 2048, 128, True),
         "d128_full": (2, 2, 1024, 128, False), "d256_causal": (2, 2, 4096, 256, True),
         "d256_full": (2, 2, 2048, 256, False)}


def capture_launches(case, p: float, ptx: bool, stored: bool = False, mask: str = ""):
    """(kernel, args, kwargs) of each Triton launch ``attention_bwd`` makes for the case, on CPU tensors."""
    from pykernels._kernels import _launch
    from pykernels._kernels import attention as tri
    b, h, s, d, causal = CASES[case]
    q, k, v, o, do = (torch.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(b, h, s)
    got = []

    class Cap:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *a, **kw: got.append((self.fn, a, kw))

    fast, ptx_rule = _launch.fast, tri._ptx_dropout
    tri._launch.fast = Cap
    tri._ptx_dropout = lambda *a, **kw: ptx and p > 0
    sm90 = tri.sm90_forward
    tri.sm90_forward = lambda *a, **kw: False  # (the Triton forward kernel, as on a card without the Gluon one)
    try:
        m = None
        if mask == "bool":  # an arbitrary boolean mask, broadcast over heads
            m = (torch.rand(b, 1, s, s) > 0.5).expand(b, h, s, s)
        elif mask == "additive":
            m = torch.randn(b, 1, s, s, dtype=torch.bfloat16).expand(b, h, s, s)
        elif mask == "keys":
            m = (torch.rand(b, 1, 1, s) > 0.5).expand(b, h, s, s)
        tri.attention_fwd(q, k, v, m, causal=causal, scale=d ** -0.5, dropout_p=p, seed=torch.tensor([5]))
        tri.attention_bwd(do, q, k, v, o, lse, m, causal=causal, scale=d ** -0.5, dropout_p=p,
                          seed=torch.tensor([5]), keep=tri.keep_buffer(b, h, s, s, "cpu") if stored else None)
    finally:
        tri.sm90_forward = sm90
        tri._launch.fast, tri._ptx_dropout = fast, ptx_rule
    return got


def compile_for_sm90(autotuner, args, kwargs, config):
    """The compiled kernel of ``autotuner``'s JIT function for these arguments and config (bm, bn, warps, stages)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature
    fn = autotuner.fn
    while not hasattr(fn, "params"):
        fn = fn.fn
    bm, bn, warps, stages = config
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kw = dict(kwargs, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    bound, spec, options = binder(*args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, options)
    return compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                   options=options.__dict__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="bert,gpt2")
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--ptx", type=int, default=1)
    ap.add_argument("--kernels", default="dq,dkdv", help="of fwd,dq,dkdv")
    ap.add_argument("--configs", default="", help="bm.bn.warps.stages,... (default: the tables' for the case)")
    ap.add_argument("--out", default="")
    ap.add_argument("--mask", default="", help="bool, additive or keys (a key-padding mask): the masked kernels")
    ap.add_argument("--stored", action="store_true", help="the backward of keep bits a forward stored (``keep``)")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "0")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import attention_sm90_gluon_ws as ws
    from attention_bwd_sass_loops import loops
    import triton

    from pykernels._kernels import attention as tri
    tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "nvdisasm")
    for case in args.cases.split(","):
        d = CASES[case][3]
        tier = tri._tier(d)
        for kern, a, kw in capture_launches(case, args.p, bool(args.ptx), args.stored, args.mask):
            name = ("fwd" if kern is tri._attention_fwd_kernel else "dq" if "COMPUTE_DELTA" in kw
                    else "dkdv" if "PTX_DROPOUT" in kw else "pre")
            if name not in args.kernels.split(","):
                continue
            if args.configs:
                cfgs = [tuple(int(x) for x in c.split(".")) for c in args.configs.split(",")]
            else:
                drop = "_short" if name == "fwd" else "_dropout"
                table = tri._TABLE[name + (drop if args.p > 0 and tier <= 128 else "")][tier]
                cfgs = list(dict.fromkeys(table + tri._TABLE[name][tier]))
            for cfg in cfgs:
                tag = f"{case} {name} p={args.p} ptx={args.ptx} {'x'.join(map(str, cfg))}"
                try:
                    ck = compile_for_sm90(kern, a, kw, cfg)
                except Exception as e:  # (a config the kernel cannot take: shared memory, shapes)
                    print(f"{tag}: compile failed: {str(e).splitlines()[0][:160]}", flush=True)
                    continue
                ttgir = ck.asm["ttgir"]
                asm_layouts = sorted(set(re.findall(r"elementwise_inline_asm.*?->\s*tensor<[^,]+,\s*(#\w+)>", ttgir)))
                defs = {m.group(1): m.group(2) for m in re.finditer(r"^(#\w+) = (#ttg\.\w+<\{.*?\}>)", ttgir, re.M)}
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(ck.asm["cubin"])
                    f.flush()
                    sass = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
                lp = loops(sass)
                longest = max((n for n, _, _ in lp), default=0)
                print(f"{tag}: {ws._ptxas_report(ck.asm['ptx'])}; shared {ck.metadata.shared} B; "
                      f"longest MMA loop {longest} instructions; "
                      f"asm layouts {[defs.get(x, x) for x in asm_layouts]}", flush=True)
                if args.out:
                    os.makedirs(args.out, exist_ok=True)
                    base = os.path.join(args.out, tag.replace(" ", "_").replace("=", ""))
                    for ext, text in (("ttgir", ttgir), ("sass", sass)):
                        with open(f"{base}.{ext}", "w") as f:
                            f.write(text)


if __name__ == "__main__":
    main()
