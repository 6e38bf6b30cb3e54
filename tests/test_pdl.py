"""Programmatic dependent launch (csrc/pdl.cuh): the C++ LayerNorm and attention kernels launched so that each may be
scheduled beside the kernel ahead of it give the results of plain launches (PYKERNELS_PDL=0), eagerly and replayed
from a CUDA graph. A kernel that read its inputs before its wait would read rows the kernel ahead had not yet
written; the chain below feeds each op's output straight into the next C++ kernel (LayerNorm into LayerNorm, the
attention's three backward kernels into each other) at sizes of several waves. It runs in a child process without
the suite's output poisoning (PYKERNELS_POISON=0): the NaN fill of every output would put a plain kernel between
every two of ours. Every attention role is launched programmatically here (PYKERNELS_PDL_ATTN=wpfc), not only the
default's sm_90a backward kernel. Then the profiler shows the launches overlapping (with PDL only). GPU only (the
source rule, every programmatic launch waits first, is checked on CPU in tests/test_csrc.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from utils import needs_cuda_ext

CHILD = textwrap.dedent("""
    import os, torch, pykernels
    M, N, B, S, H, D = 16384, 1024, 32, 512, 16, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * scale).requires_grad_(True)
    x, r = rnd(M, N), rnd(M, N)
    w, b = rnd(N, scale=0.5), rnd(N, scale=0.5)
    gy, gs = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g), torch.randn(
        M, N, device="cuda", dtype=torch.bfloat16, generator=g)

    def chain(det):
        y, s = x, r
        for _ in range(2):
            y, s = pykernels.layer_norm(y, w, b, residual=s, prenorm=True, backend="cuda")
            y = pykernels.layer_norm(y, w, b, backend="cuda")  # (reads the kernel ahead's y)
            q = y.view(B, S, H, D).transpose(1, 2)
            o = pykernels.scaled_dot_product_attention(q, q, q, backend="cuda", deterministic=det)
            y = o.transpose(1, 2).reshape(M, N)
        return (y, s) + torch.autograd.grad((y, s), (x, r, w, b), (gy, gs))

    def setting(pdl):
        os.environ["PYKERNELS_PDL"] = pdl
        os.environ["PYKERNELS_PDL_ATTN"] = "wpfc" if pdl == "1" else ""  # (every attention role: pdl.cuh's rule)

    def eager(pdl, det):
        setting(pdl)
        out = chain(det)
        torch.cuda.synchronize()
        return [t.detach().clone() for t in out]

    def replayed(pdl, det):
        setting(pdl)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            chain(det)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(det)
        outs = []
        for _ in range(3):
            for t in out:
                t.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            outs.append([t.detach().clone() for t in out])
        return outs

    names = ("y", "s", "dx", "dr", "dw", "db")
    ref = eager("0", True)
    assert all(torch.isfinite(t).all() for t in ref)
    for got in [eager("1", True), eager("1", True)] + replayed("1", True):
        for n, a, c in zip(names, ref, got):
            assert torch.equal(a, c), n
    # the fused backward (dQ added by bulk reductions: its order, and so dQ's rounding, varies by run)
    ref = eager("0", False)
    for got in [eager("1", False)] + replayed("1", False):
        for n, a, c in zip(names, ref, got):
            torch.testing.assert_close(c.float(), a.float(), rtol=2e-2, atol=2e-2 * a.float().abs().max().item(),
                                       msg=n)

    # the launches do overlap: six LayerNorms queued behind a sleep, each reading the one ahead's output, start before
    # the one ahead has ended with PDL (its blocks resident and waiting) and never without; a build whose kernels lack
    # the wait (pdl.cuh's pdl_on) would show no overlap here
    from torch.profiler import ProfilerActivity, profile

    def overlaps(pdl):
        setting(pdl)
        xd = x.detach()
        with torch.no_grad():
            pykernels.layer_norm(xd, w, b, backend="cuda")
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                torch.cuda._sleep(50_000_000)
                y = xd
                for _ in range(6):
                    y = pykernels.layer_norm(y, w, b, backend="cuda")
                torch.cuda.synchronize()
        ev = sorted((e for e in prof.events() if "ln_fwd" in e.name), key=lambda e: e.time_range.start)
        return len(ev), sum(c.time_range.start < a.time_range.end for a, c in zip(ev, ev[1:]))

    (k1, n1), (k0, n0) = overlaps("1"), overlaps("0")
    assert k1 == k0 == 6 and n1 >= 1 and n0 == 0, (k1, n1, k0, n0)
    print("ok")
""")


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_programmatic_launches_equal_plain_ones():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 (elsewhere launches are plain)")
    env = {**os.environ, "PYKERNELS_POISON": "0"}
    env.pop("PYKERNELS_PDL", None)
    env.pop("PYKERNELS_PDL_ATTN", None)
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
