"""The int64-offset attention case of ``tests/test_attention.py::test_gpu_int64_offsets`` (B8192 H16 S136
D128 causal, 2.28e9 elements per tensor) stage by stage, synchronising after each, so that an asynchronous
error names its stage: inputs, forward, backward, references. Run it in a loop beside other GPU load to
chase the intermittent illegal address of run93 (``--stage-sync`` off: one sync at the end)."""
from __future__ import annotations

import sys

import torch

import pykernels
from pykernels.attention import attention_reference


def main() -> None:
    import os
    b, h, s, d = int(os.environ.get("PROBE_B", 8192)), 16, int(os.environ.get("PROBE_S", 136)), 128
    torch.manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 0)
    from pykernels._kernels import attention_sm90_bwd as kb
    for arg in sys.argv[2:]:  # module settings of attention_sm90_bwd, e.g. CAUSAL_LPT=False
        name, value = arg.split("=", 1)
        setattr(kb, name, eval(value))
    stage = "inputs"
    try:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        torch.cuda.synchronize()
        stage = "forward"
        out = pykernels.scaled_dot_product_attention(q, k, v, is_causal=True, backend="triton")
        torch.cuda.synchronize()
        stage = "backward"
        do = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
        torch.cuda.synchronize()
        stage = "reference"
        tail = slice(b - 2, b)
        qq, kk, vv = (t.detach()[tail].double().requires_grad_(True) for t in (q, k, v))
        o = attention_reference(qq, kk, vv, is_causal=True)
        g = torch.autograd.grad(o, (qq, kk, vv), do[tail].double())
        err = max((a[tail].double() - r).abs().max().item() for a, r in zip((out, dq, dk, dv), (o, *g)))
        print(f"ok, max error of the last two batches {err:.3e}", flush=True)
    except Exception as e:  # noqa: BLE001 - the probe reports the stage
        import traceback
        frames = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)]
        print(f"FAILED at {stage}: {type(e).__name__}: {str(e).splitlines()[0]} [{' <- '.join(frames[::-1][:6])}]",
              flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
