"""`make demo`: a correctness-and-speed report of every op against its reference on this machine.

For each op and case: the Triton kernel's largest error against a float64 eager reference, next to
the error of the same eager reference run in the kernel's own dtype (the three-way rule: the kernel
passes when its error is at most 2x the eager error plus a small atol), over the output and every
gradient; then the forward+backward time of the kernel and of the eager reference.

On a CPU-only machine the kernels run under TRITON_INTERPRET=1 on tiny shapes in float32: the
correctness columns are real, the times are the interpreter's and say nothing about GPU speed.
On a GPU the shapes are BERT/GPT-sized, bf16, and timed with triton.testing.do_bench.
"""
from __future__ import annotations

import os
import sys
import time

import torch

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


def _cases():
    """(op, case, make_inputs() -> list of tensors, kernel(*t), reference(*t)); the first `n_diff`
    tensors are differentiated."""
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
           lambda q, k, v: pykernels.scaled_dot_product_attention(q, k, v, is_causal=True, backend="triton"),
           lambda q, k, v: attention_reference(q, k, v, is_causal=True), 3)
    yield ("attention", f"key padding B{B} H{H} S{S} D{D}", attn_in,
           lambda q, k, v: pykernels.scaled_dot_product_attention(q, k, v, attn_mask=kpm, backend="triton"),
           lambda q, k, v: attention_reference(q, k, v, attn_mask=kpm), 3)

    def ln_in():
        return [g(N, HID), g(N, HID), 1 + 0.1 * g(HID), 0.1 * g(HID)]

    yield ("layer_norm", f"pre-LN {N}x{HID}", ln_in,
           lambda x, r, w, b: pykernels.layer_norm(x, w, b, residual=r, prenorm=True, backend="triton")[0],
           lambda x, r, w, b: layer_norm_reference(x, w, b, residual=r, prenorm=True)[0], 4)
    yield ("layer_norm", f"post-LN {N}x{HID}", ln_in,
           lambda x, r, w, b: pykernels.layer_norm(x, w, b, residual=r, backend="triton"),
           lambda x, r, w, b: layer_norm_reference(x, w, b, residual=r), 4)

    target = torch.randint(0, V, (M,), device=DEV)
    target[torch.rand(M, device=DEV) < 0.1] = -100
    yield ("cross_entropy", f"{M}x{V}", lambda: [g(M, V)],
           lambda x: pykernels.cross_entropy(x, target, backend="triton"),
           lambda x: cross_entropy_reference(x, target), 1)

    mlm_target = torch.randint(0, V, (N,), device=DEV)
    mlm_target[torch.rand(N, device=DEV) >= 0.15] = -100
    yield ("masked_lm_loss", f"{N} tokens 15% masked, H{HID} V{V}",
           lambda: [g(N, HID), 0.05 * g(V, HID)],
           lambda h, w: pykernels.masked_lm_loss(h, w, mlm_target, backend="triton"),
           lambda h, w: masked_lm_loss_reference(h, w, mlm_target), 2)


def _run(fn, inputs, n_diff, grad_out):
    xs = [t.detach().clone().requires_grad_(i < n_diff) for i, t in enumerate(inputs)]
    out = fn(*xs)
    grads = torch.autograd.grad(out, xs[:n_diff], grad_out.to(out.dtype))
    return [out.detach(), *grads]


def _time(fn, inputs, n_diff, grad_out):
    call = lambda: _run(fn, inputs, n_diff, grad_out)  # noqa: E731
    if GPU:
        import triton.testing
        return triton.testing.do_bench(call, warmup=5, rep=30, return_mode="median")
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1e3


def main() -> int:
    print(f"pykernels {pykernels.__version__} on {torch.cuda.get_device_name() if GPU else 'CPU (Triton interpreter)'}, "
          f"torch {torch.__version__}, dtype {str(DTYPE).replace('torch.', '')}")
    print("backends:", {k: ("available" if v.available else f"missing: {v.reason}") for k, v in pykernels.backends().items()})
    rows, failures = [], 0
    for op, case, make, kernel, ref, n_diff in _cases():
        torch.manual_seed(0)
        inputs = make()
        out_ref = ref(*inputs)
        grad_out = torch.randn_like(out_ref.float()) if out_ref.dim() else torch.tensor(1.0, device=DEV)
        got = _run(kernel, inputs, n_diff, grad_out)
        lo = _run(ref, inputs, n_diff, grad_out)
        hi = _run(ref, [t.double() for t in inputs], n_diff, grad_out.double())
        err = max((a.double() - h).abs().max().item() for a, h in zip(got, hi))
        base = max((a.double() - h).abs().max().item() for a, h in zip(lo, hi))
        ok = all(torch.isfinite(a).all() for a in got) and err <= 2 * base + ATOL
        failures += not ok
        t_k = _time(kernel, inputs, n_diff, grad_out)
        t_r = _time(ref, inputs, n_diff, grad_out)
        rows.append((op, case, f"{err:.2e}", f"{base:.2e}", "pass" if ok else "FAIL",
                     f"{t_k:.3f}", f"{t_r:.3f}", f"{t_r / t_k:.2f}x"))
    head = ("op", "case", "kernel err", "eager err", "2x rule", "kernel fwd+bwd ms", "eager ms", "speedup")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    if not GPU:
        print("(times are the Triton CPU interpreter's and the eager CPU reference's: not a speed measure)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
