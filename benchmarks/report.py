"""`make demo`: a correctness-and-speed report of every op against its reference on this machine.

For each op, case and kernel backend (Triton; on a GPU with the extension built, CUDA C++ too): the kernel's
error against a float64 eager reference next to the error of the same eager reference run in the kernel's own
dtype, tensor by tensor over the output and every gradient (the three-way rule: the kernel passes when each of its
errors is at most 2x the eager error plus a small atol; the worst tensor's pair is printed); then the
forward+backward time of the kernel and of the eager reference, twice on a GPU: GPU time (the device time of every
kernel a call issues, torch.profiler: what a training step sees when the host keeps ahead) and wall time
(triton.testing.do_bench on plain Python calls, host included: at these sizes the host's Python, not the GPU, often
sets that pace, for pykernels' Triton path most of all: README, Measured).

On a CPU-only machine the kernels run under TRITON_INTERPRET=1 on tiny shapes in float32: the
correctness columns are real, the times are the interpreter's and say nothing about GPU speed.
On a GPU the shapes are BERT/GPT-sized, bf16.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (benchmarks/common.py, for the GPU times)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pykernels  # noqa: E402
from pykernels.attention import attention_reference  # noqa: E402
from pykernels.cross_entropy import cross_entropy_reference  # noqa: E402
from pykernels.layer_norm import layer_norm_reference  # noqa: E402
from pykernels.masked_lm_loss import masked_lm_loss_reference  # noqa: E402

GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if GPU else "cpu")
DTYPE = torch.bfloat16 if GPU else torch.float32
ATOL = 1e-2 if GPU else 1e-5


def _cases(backend: str):
    """(op, case, make_inputs() -> list of tensors, kernel(*t) on ``backend``, reference(*t), n_diff): the first
    `n_diff` tensors are differentiated."""
    g = lambda *s: torch.randn(*s, device=DEV, dtype=DTYPE)  # noqa: E731
    if GPU:
        B, H, S, D, N, HID, V, M = 8, 12, 1024, 64, 16384, 768, 30522, 16384
    else:
        B, H, S, D, N, HID, V, M = 2, 2, 40, 32, 64, 96, 517, 48

    def attn_in():
        return [g(B, H, S, D), g(B, H, S, D), g(B, H, S, D)]

    pad_len = torch.randint(S // 2, S + 1, (B,), device=DEV)
    kpm = (torch.arange(S, device=DEV)[None, :] < pad_len[:, None])[:, None, None, :]
    yield ("attention", f"causal B{B} H{H} S{S} D{D}", attn_in,
           lambda q, k, v: pykernels.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend),
           lambda q, k, v: attention_reference(q, k, v, is_causal=True), 3)
    yield ("attention", f"key padding B{B} H{H} S{S} D{D}", attn_in,
           lambda q, k, v: pykernels.scaled_dot_product_attention(q, k, v, attn_mask=kpm, backend=backend),
           lambda q, k, v: attention_reference(q, k, v, attn_mask=kpm), 3)

    def ln_in():
        return [g(N, HID), g(N, HID), 1 + 0.1 * g(HID), 0.1 * g(HID)]

    yield ("layer_norm", f"pre-LN {N}x{HID}", ln_in,
           lambda x, r, w, b: pykernels.layer_norm(x, w, b, residual=r, prenorm=True, backend=backend)[0],
           lambda x, r, w, b: layer_norm_reference(x, w, b, residual=r, prenorm=True)[0], 4)
    yield ("layer_norm", f"post-LN {N}x{HID}", ln_in,
           lambda x, r, w, b: pykernels.layer_norm(x, w, b, residual=r, backend=backend),
           lambda x, r, w, b: layer_norm_reference(x, w, b, residual=r), 4)

    target = torch.randint(0, V, (M,), device=DEV)
    target[torch.rand(M, device=DEV) < 0.1] = -100
    yield ("cross_entropy", f"{M}x{V}", lambda: [g(M, V)],
           lambda x: pykernels.cross_entropy(x, target, backend=backend),
           lambda x: cross_entropy_reference(x, target), 1)

    mlm_target = torch.randint(0, V, (N,), device=DEV)
    mlm_target[torch.rand(N, device=DEV) >= 0.15] = -100
    yield ("masked_lm_loss", f"{N} tokens 15% masked, H{HID} V{V}",
           lambda: [g(N, HID), 0.05 * g(V, HID)],
           lambda h, w: pykernels.masked_lm_loss(h, w, mlm_target, backend=backend),
           lambda h, w: masked_lm_loss_reference(h, w, mlm_target), 2)


def _run(fn, inputs, n_diff, grad_out):
    xs = [t.detach().clone().requires_grad_(i < n_diff) for i, t in enumerate(inputs)]
    out = fn(*xs)
    grads = torch.autograd.grad(out, xs[:n_diff], grad_out.to(out.dtype))
    return [out.detach(), *grads]


def _times(fn, inputs, n_diff, grad_out) -> tuple[float | None, float]:
    """(GPU ms, wall ms) of a forward+backward call; on a CPU (None, the interpreter's wall time of one call).
    ``grad_out`` already in the output's dtype (the checked call's)."""
    xs = [t.detach().clone().requires_grad_(i < n_diff) for i, t in enumerate(inputs)]  # (cloned once: not timed)
    call = lambda: torch.autograd.grad(fn(*xs), xs[:n_diff], grad_out)  # noqa: E731
    if GPU:
        from common import bench, gpu_kernel_ms
        wall = bench(call, warmup=5, rep=30)
        return gpu_kernel_ms(call), wall
    t0 = time.perf_counter()
    call()
    return None, (time.perf_counter() - t0) * 1e3


def _errors(got, lo, hi) -> tuple[bool, float, float]:
    """(each tensor within 2x the eager error plus ATOL and finite, the worst tensor's kernel error, its eager
    error): the worst by kernel error over its allowance."""
    worst, pair, ok = -1.0, (0.0, 0.0), True
    for a, b, h in zip(got, lo, hi):
        err = (a.double() - h).abs().max().item()
        base = (b.double() - h).abs().max().item()
        ok = ok and bool(torch.isfinite(a).all()) and err <= 2 * base + ATOL
        if err / (2 * base + ATOL) > worst:
            worst, pair = err / (2 * base + ATOL), (err, base)
    return ok, *pair


def _backends() -> list[str]:
    """The kernel backends to report: Triton, and the CUDA C++ one where it is built and the tensors are CUDA."""
    have = pykernels.backends()
    return ["triton"] + (["cuda"] if GPU and have["cuda"].available else [])


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> int:
    where = torch.cuda.get_device_name() if GPU else "CPU (Triton interpreter)"
    print(f"pykernels {pykernels.__version__} on {where}, torch {torch.__version__}, "
          f"dtype {str(DTYPE).replace('torch.', '')}")
    have = pykernels.backends().items()
    print("backends:", {k: ("available" if v.available else f"missing: {v.reason}") for k, v in have})
    rows, failures = [], 0
    for backend in _backends():
        for op, case, make, kernel, ref, n_diff in _cases(backend):
            torch.manual_seed(0)
            inputs = make()
            out_ref = ref(*inputs)
            grad_out = torch.randn_like(out_ref.float()) if out_ref.dim() else torch.tensor(1.0, device=DEV)
            try:
                got = _run(kernel, inputs, n_diff, grad_out)
            except pykernels.BackendUnavailableError as err:  # (a case this backend does not cover: said, not run)
                rows.append((op, case, backend, f"not covered: {str(err)[:60]}", "", "", "", "", "", "", "", ""))
                continue
            lo = _run(ref, inputs, n_diff, grad_out)
            hi = _run(ref, [t.double() for t in inputs], n_diff, grad_out.double())
            ok, err, base = _errors(got, lo, hi)
            failures += not ok
            g_k, w_k = _times(kernel, inputs, n_diff, grad_out.to(got[0].dtype))
            g_r, w_r = _times(ref, inputs, n_diff, grad_out.to(lo[0].dtype))
            rows.append((op, case, backend, f"{err:.2e}", f"{base:.2e}", "pass" if ok else "FAIL",
                         _ms(g_k), _ms(g_r), "-" if g_k is None else f"{g_r / g_k:.2f}x",
                         _ms(w_k), _ms(w_r), f"{w_r / w_k:.2f}x" if GPU else "-"))
    head = ("op", "case", "backend", "kernel err", "eager err", "2x rule", "GPU ms", "eager GPU ms", "GPU speedup",
            "wall ms", "eager wall ms", "wall speedup")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    if GPU:
        print("(forward+backward a call. GPU ms: the device time of its kernels (torch.profiler); wall ms: do_bench on "
              "eager calls, host included. err: the worst tensor's largest error against float64, and the eager "
              "reference's in the same dtype)")
    if not GPU:
        print("(times are the Triton CPU interpreter's and the eager CPU reference's: not a speed measure)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
