"""pykernels.cross_entropy: loss and dlogits vs the float64 reference by the three-way rule.

CPU: the Triton kernels under the interpreter (fp32/fp16, explicit backend="triton"), tiny shapes.
GPU (marked): bf16 at training shapes, torch.compile with Inductor, a > 2**31-element case.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import pykernels
from pykernels import BackendUnavailableError, FallbackWarning
from pykernels.cross_entropy import cross_entropy_reference
from utils import assert_close_to_ref, cuda_built, needs_cuda_ext

CPU_DTYPES = [torch.float32, torch.float16]


def _targets(N, V, device, *, ignore_frac=0.3, ignore_index=-100):
    t = torch.randint(0, V, (N,), device=device)
    ignored = torch.rand(N, device=device) < ignore_frac
    ignored[0] = False  # at least one valid row
    return torch.where(ignored, torch.full_like(t, ignore_index), t)


def _loss_and_grad(fn, logits, target, upstream, **kw):
    """Loss and dlogits of ``fn`` (cross_entropy or its reference) on a fresh leaf copy of logits."""
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, target, **kw)
    loss.backward(upstream.to(loss.dtype))
    return loss.detach(), x.grad


def _check(logits, target, *, backend="triton", **kw):
    """Three-way rule on the loss and on dlogits (fresh random upstream gradient)."""
    red = kw.get("reduction", "mean")
    upstream = (torch.randn(target.shape, device=logits.device) if red == "none"
                else torch.randn((), device=logits.device))
    # Representable in the logits' dtype, so every contender (and float64) sees the same upstream.
    upstream = upstream.to(logits.dtype).float()
    out, g = _loss_and_grad(pykernels.cross_entropy, logits, target, upstream, backend=backend, **kw)
    hi, g_hi = _loss_and_grad(cross_entropy_reference, logits.double(), target, upstream.double(), **kw)
    lo, g_lo = _loss_and_grad(cross_entropy_reference, logits, target, upstream, **kw)
    assert out.dtype == logits.dtype and g.dtype == logits.dtype
    assert_close_to_ref("loss", out, hi, lo)
    assert_close_to_ref("dlogits", g, g_hi, g_lo)
    return out, g


# ---------------------------------------------------------------------------------------------
# CPU (interpreter)
# ---------------------------------------------------------------------------------------------

def test_many_rows_reduction_loop(device):
    """More rows than the one-program reduction's block (32 under the interpreter, up to 8192 on the
    GPU): its loop, the partial last block and the on-device valid count (ignored rows included)."""
    N = 150 if device.type == "cpu" else 20011
    logits = torch.randn(N, 5, device=device) * 2
    target = _targets(N, 5, device, ignore_frac=0.4)
    _check(logits, target, reduction="mean")  # loss and dlogits by the three-way rule
    # "sum" and a caller's denominator: against float64 with a relative tolerance (the rounding of a
    # 20011-term fp32 sum is luck either way, so a 2x-eager rule would be a coin toss; a block of rows
    # dropped or counted twice moves the result by > 1e-2 relative)
    ref_sum = cross_entropy_reference(logits.double(), target, reduction="sum")
    got_sum = pykernels.cross_entropy(logits, target, reduction="sum", backend="triton")
    torch.testing.assert_close(got_sum.double(), ref_sum, rtol=1e-5, atol=0)
    got_nv = pykernels.cross_entropy(logits, target, reduction="mean", backend="triton", num_valid=7)
    torch.testing.assert_close(got_nv.double(), ref_sum / 7, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("V", [1, 517])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_reference(device, dtype, V, reduction):
    logits = torch.randn(13, V, device=device, dtype=dtype) * 3
    _check(logits, _targets(13, V, device), reduction=reduction)


@pytest.mark.parametrize("V", [30522, 50257, 256000])
def test_large_vocab(device, V):
    logits = torch.randn(3, V, device=device) * 2
    target = torch.tensor([5, -100, V - 1], device=device)
    _check(logits, target, reduction="none")


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing,z_loss", [(0.1, 0.0), (0.0, 1e-2), (0.25, 1e-3), (1.0, 0.0)])
def test_smoothing_and_z_loss(device, dtype, reduction, label_smoothing, z_loss):
    V = 300
    logits = torch.randn(9, V, device=device, dtype=dtype) * 2
    _check(logits, _targets(9, V, device), reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss)


def test_matches_torch_functional(device):
    """Without z-loss the semantics are exactly F.cross_entropy's (mean over valid targets, smoothing)."""
    logits = torch.randn(11, 200, device=device, dtype=torch.float64)
    target = _targets(11, 200, device)
    for kw in [dict(), dict(label_smoothing=0.2), dict(reduction="sum"), dict(reduction="none", label_smoothing=0.1)]:
        ours = pykernels.cross_entropy(logits.float(), target, backend="triton", **kw)
        ref = F.cross_entropy(logits, target, **kw)
        torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(device, reduction):
    logits = torch.randn(5, 130, device=device, requires_grad=True)
    target = torch.full((5,), -100, device=device)
    loss = pykernels.cross_entropy(logits, target, reduction=reduction, backend="triton", z_loss=1e-2,
                                   label_smoothing=0.1)
    assert torch.equal(loss.detach(), torch.zeros_like(loss))   # mean too: 0, never NaN
    loss.sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_custom_ignore_index(device):
    logits = torch.randn(7, 100, device=device)
    target = _targets(7, 100, device, ignore_index=3, ignore_frac=0.5)
    _check(logits, target, ignore_index=3)
    target = _targets(7, 100, device, ignore_index=0, ignore_frac=0.0)  # none ignored
    _check(logits, target, ignore_index=-1)


@pytest.mark.parametrize("kind", ["int", "tensor"])
def test_num_valid(device, kind):
    """Gradient accumulation: dividing by a global count equals sum / count, loss and gradient."""
    logits = torch.randn(8, 150, device=device)
    target = _targets(8, 150, device)
    nv = 37 if kind == "int" else torch.tensor(37, device=device)
    upstream = torch.randn((), device=device)
    out, g = _loss_and_grad(pykernels.cross_entropy, logits, target, upstream, backend="triton", num_valid=nv)
    ref, g_ref = _loss_and_grad(pykernels.cross_entropy, logits, target, upstream, backend="triton", reduction="sum")
    torch.testing.assert_close(out, ref / 37)
    torch.testing.assert_close(g, g_ref / 37)
    hi, g_hi = _loss_and_grad(cross_entropy_reference, logits.double(), target, upstream.double(), num_valid=nv)
    lo, g_lo = _loss_and_grad(cross_entropy_reference, logits, target, upstream, num_valid=nv)
    assert_close_to_ref("loss", out, hi, lo)
    assert_close_to_ref("dlogits", g, g_hi, g_lo)
    # A global count of 0 (every target ignored everywhere) gives 0, not NaN.
    ignored = torch.full_like(target, -100)
    zero = pykernels.cross_entropy(logits, ignored, num_valid=0, backend="triton")
    assert zero.item() == 0.0


def test_strided_and_batched(device):
    """A row-strided slice of a padded buffer, (B, T, V) logits with (B, T) targets, and a
    non-contiguous target, all against the reference."""
    V = 257
    buf = torch.randn(10, V + 9, device=device)
    logits = buf[:, 3:3 + V]                      # row stride V + 9, unit column stride
    assert logits.stride() == (V + 9, 1)
    _check(logits, _targets(10, V, device), reduction="none")
    logits3 = torch.randn(2, 5, V, device=device)
    target3 = _targets(10, V, device).reshape(2, 5)
    out, _ = _check(logits3, target3, reduction="none")
    assert out.shape == (2, 5)
    _check(logits3, target3, reduction="mean", label_smoothing=0.1)
    tbig = _targets(20, V, device)
    _check(torch.randn(10, V, device=device), tbig[::2])
    # Column-strided logits (a transpose) are copied, and still correct.
    _check(torch.randn(V, 6, device=device).t(), _targets(6, V, device))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("V", [2, 3, 7, 8, 9, 136, 263])
def test_row_alignments(device, dtype, V):
    """Rows start at every offset modulo 16 bytes (contiguous odd V); short rows that fit in the
    head piece; rows that end inside the head, the body, or one element past a chunk."""
    logits = torch.randn(11, V, device=device, dtype=dtype) * 2
    _check(logits, _targets(11, V, device), reduction="none", label_smoothing=0.1)


@pytest.mark.parametrize("offset,pad", [(8, 16), (8, 9), (3, 8)])
def test_padded_buffers(device, offset, pad):
    """Slices of a padded fp16 buffer: 16-byte-aligned base with a row stride congruent (or not) to
    V modulo 8 elements, and an unaligned base; also overwritten in place."""
    _padded_buffer_case(device, 201, offset, pad, "triton")


def _padded_buffer_case(device, V, offset, pad, backend):
    """Rows [offset, offset + V) of a padded fp16 buffer against the reference, then the gradient written over
    them in place: bitwise the out-of-place one, in the view's own memory, the padding untouched."""
    buf = torch.randn(9, V + pad + offset, device=device, dtype=torch.float16)
    logits = buf[:, offset:offset + V]
    target = _targets(9, V, device)
    _check(logits, target, backend=backend, reduction="none", z_loss=1e-2)
    out, g = _loss_and_grad(pykernels.cross_entropy, logits, target, torch.ones((), device=device), backend=backend)
    base = buf.detach().clone()                             # same strides and alignment as buf
    view = base[:, offset:offset + V]
    view.requires_grad_()
    loss = pykernels.cross_entropy(view, target, backend=backend, inplace_backward=True)
    (grad,) = torch.autograd.grad(loss, view)
    assert grad.data_ptr() == view.data_ptr()
    torch.testing.assert_close(loss, out, rtol=0, atol=0)
    torch.testing.assert_close(grad, g, rtol=0, atol=0)
    # The padding around the rows is untouched.
    torch.testing.assert_close(base[:, :offset], buf[:, :offset], rtol=0, atol=0)
    torch.testing.assert_close(base[:, offset + V:], buf[:, offset + V:], rtol=0, atol=0)


def test_int32_and_small_int_targets(device):
    logits = torch.randn(6, 200, device=device)
    target = torch.randint(0, 200, (6,), device=device)
    ref = pykernels.cross_entropy(logits, target, backend="triton", reduction="none")
    for dt in (torch.int32, torch.int16, torch.uint8):
        out = pykernels.cross_entropy(logits, target.to(dt), backend="triton", reduction="none")
        torch.testing.assert_close(out, ref)


def test_inplace_backward(device):
    """inplace_backward: same loss and gradient, and the gradient lives in the logits' buffer."""
    base = torch.randn(9, 517, device=device, requires_grad=True)
    target = _targets(9, 517, device)
    loss = pykernels.cross_entropy(base * 2, target, backend="triton", label_smoothing=0.1, z_loss=1e-2)
    loss.backward()
    g_ref = base.grad.clone()
    base.grad = None
    logits = base * 2                             # non-leaf, as the output of an LM head would be
    ptrs = []
    logits.register_hook(lambda g: ptrs.append(g.data_ptr()))
    loss2 = pykernels.cross_entropy(logits, target, backend="triton", label_smoothing=0.1, z_loss=1e-2,
                                    inplace_backward=True)
    assert torch.equal(loss2, loss)
    loss2.backward()
    assert ptrs == [logits.data_ptr()]            # the gradient reused the logits buffer
    torch.testing.assert_close(base.grad, g_ref, rtol=0, atol=0)
    # ... and by default it does not.
    logits3 = base.detach() * 2
    logits3.requires_grad_()
    before = logits3.detach().clone()
    pykernels.cross_entropy(logits3, target, backend="triton").backward()
    assert torch.equal(logits3.detach(), before)


def test_inplace_backward_detects_saved_logits(device):
    """If another op saved the logits for its backward, overwriting them is an autograd error, not a
    silent wrong gradient."""
    base = torch.randn(4, 64, device=device, requires_grad=True)
    logits = base * 1.0
    target = torch.randint(0, 64, (4,), device=device)
    other = (logits * logits).sum()               # saves logits
    loss = pykernels.cross_entropy(logits, target, backend="triton", inplace_backward=True) + other
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("inplace", [False, True])
def test_compile_fullgraph(device, reduction, inplace):
    logits = torch.randn(7, 300, device=device)
    target = _targets(7, 300, device)

    def f(x, t):
        return pykernels.cross_entropy(x * 1.5, t, reduction=reduction, label_smoothing=0.1, z_loss=1e-3,
                                       backend="triton", inplace_backward=inplace)

    upstream = torch.randn(target.shape, device=device) if reduction == "none" else torch.randn((), device=device)
    eager, g_eager = _loss_and_grad(f, logits, target, upstream)
    torch._dynamo.reset()
    compiled, g_comp = _loss_and_grad(torch.compile(f, fullgraph=True, backend="aot_eager"), logits, target,
                                      upstream)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(g_comp, g_eager)


@pytest.mark.parametrize("shift", [-30.0, 7.5, 1000.0])
def test_shift_invariance(device, shift):
    """Adding a constant to a row of logits changes neither the loss nor the gradient."""
    logits = torch.randn(6, 333, device=device)
    target = _targets(6, 333, device)
    shifts = torch.tensor([shift, 0.0, -shift, shift / 2, 1.0, 0.0], device=device)[:, None]
    kw = dict(backend="triton", reduction="none", label_smoothing=0.1)
    upstream = torch.randn(6, device=device)
    a, ga = _loss_and_grad(pykernels.cross_entropy, logits, target, upstream, **kw)
    b, gb = _loss_and_grad(pykernels.cross_entropy, logits + shifts, target, upstream, **kw)
    # fp32 ulp of the shifted logits bounds how exactly the shift cancels
    tol = 4 * abs(shift) * 2**-23 * 333 ** 0.5 + 1e-5
    torch.testing.assert_close(b, a, rtol=0, atol=tol)
    torch.testing.assert_close(gb, ga, rtol=0, atol=tol)


@pytest.mark.parametrize("V", [1, 2, 517, 30522])
def test_equal_logits_give_log_v(device, V):
    logits = torch.full((3, V), 2.5, device=device) + torch.randn(3, 1, device=device)
    target = torch.randint(0, V, (3,), device=device)
    out = pykernels.cross_entropy(logits, target, backend="triton", reduction="none")
    torch.testing.assert_close(out, torch.full((3,), math.log(V), device=device), rtol=1e-6, atol=1e-6)


def test_gradcheck_reference_fp64(device):
    """The op's reference backend (used as the fallback) has the right backward, by gradcheck."""
    logits = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([1, -100, 6, 0])
    for kw in [dict(), dict(label_smoothing=0.2, z_loss=0.1), dict(reduction="none", z_loss=0.05)]:
        assert torch.autograd.gradcheck(
            lambda x: pykernels.cross_entropy(x, target, backend="reference", **kw), (logits,))


def test_backend_selection(device):
    logits = torch.randn(4, 50)
    target = torch.randint(0, 50, (4,))
    with pytest.raises(BackendUnavailableError, match="cuda"):
        pykernels.cross_entropy(logits, target, backend="cuda")
    ref = cross_entropy_reference(logits, target)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # auto on CPU is the reference, silently
        torch.testing.assert_close(pykernels.cross_entropy(logits, target), ref)
    with pykernels.use_backend("reference"):
        torch.testing.assert_close(pykernels.cross_entropy(logits, target), ref)
    # float64 is a case the kernel declines. On the kernel device (so the refusal is the dtype's, not
    # the device's): explicit triton raises naming float64; auto falls back to the reference (on CUDA
    # with a FallbackWarning naming float64; on CPU auto is the reference, silently).
    ld, td = logits.double().to(device), target.to(device)
    with pytest.raises(BackendUnavailableError, match="float64"):
        pykernels.cross_entropy(ld, td, backend="triton")
    import pykernels._backend as be
    be._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = pykernels.cross_entropy(ld, td)
    fallbacks = [w for w in caught if issubclass(w.category, FallbackWarning)]
    if device.type == "cuda":
        assert len(fallbacks) == 1 and "float64" in str(fallbacks[0].message)
    else:
        assert fallbacks == []
    torch.testing.assert_close(got, cross_entropy_reference(ld, td))


def test_out_of_range_target(device):
    logits = torch.randn(4, 10, device=device)
    bad = torch.tensor([1, 10, -100, 2], device=device)
    with pytest.raises(ValueError, match=r"target values must be in \[0, 10\)"):
        cross_entropy_reference(logits, bad)
    with pytest.raises(ValueError, match="target values"):
        pykernels.cross_entropy(logits, bad, backend="reference")
    with pytest.raises(ValueError, match="target values"):
        pykernels.cross_entropy(logits, torch.tensor([1, -1, 0, 2], device=device), backend="reference")
    # The Triton path cannot check without a host sync: it never reads out of bounds and makes the
    # offending row's loss and gradient NaN (the others stay right).
    x = logits.clone().requires_grad_()
    rows = pykernels.cross_entropy(x, bad, backend="triton", reduction="none")
    assert torch.isnan(rows[1]) and torch.isfinite(rows[[0, 2, 3]]).all()
    rows.sum().backward()
    assert torch.isnan(x.grad[1]).all() and torch.isfinite(x.grad[[0, 2, 3]]).all()
    assert torch.isnan(pykernels.cross_entropy(logits, bad, backend="triton"))


def test_bad_inputs(device):
    x = torch.randn(4, 10)
    t = torch.randint(0, 10, (4,))
    with pytest.raises(TypeError, match="target must have an integer dtype"):
        pykernels.cross_entropy(x, t.float())
    with pytest.raises(TypeError, match="target must have an integer dtype"):
        pykernels.cross_entropy(x, t > 3)
    with pytest.raises(TypeError, match="target must be a torch.Tensor"):
        pykernels.cross_entropy(x, [1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"target must have shape logits.shape\[:-1\] = \(4,\)"):
        pykernels.cross_entropy(x, t[:3])
    with pytest.raises(TypeError, match="logits must have dtype"):
        pykernels.cross_entropy(x.long(), t)
    with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
        pykernels.cross_entropy(x.numpy(), t)
    with pytest.raises(ValueError, match="logits must have at least 1 dims"):
        pykernels.cross_entropy(torch.tensor(1.0), t)
    with pytest.raises(ValueError, match="non-empty last"):
        pykernels.cross_entropy(torch.randn(4, 0), t)
    with pytest.raises(ValueError, match="reduction must be one of"):
        pykernels.cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        pykernels.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(TypeError, match="label_smoothing"):
        pykernels.cross_entropy(x, t, label_smoothing="0.1")
    with pytest.raises(ValueError, match="z_loss"):
        pykernels.cross_entropy(x, t, z_loss=-1e-4)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        pykernels.cross_entropy(x, t, ignore_index=1.0)
    with pytest.raises(ValueError, match="num_valid applies only to reduction='mean'"):
        pykernels.cross_entropy(x, t, reduction="sum", num_valid=3)
    with pytest.raises(ValueError, match="num_valid must be an int or a 0-dim tensor"):
        pykernels.cross_entropy(x, t, num_valid=torch.tensor([3]))
    with pytest.raises(TypeError, match="num_valid must be an int"):
        pykernels.cross_entropy(x, t, num_valid=3.0)
    with pytest.raises(ValueError, match="num_valid must be >= 0"):
        pykernels.cross_entropy(x, t, num_valid=-2)
    with pytest.raises(TypeError, match="inplace_backward must be a bool"):
        pykernels.cross_entropy(x, t, inplace_backward=1)
    with pytest.raises(ValueError, match="backend must be one of"):
        pykernels.cross_entropy(x, t, backend="cudnn")
    with pytest.raises(TypeError):
        pykernels.cross_entropy(x, t, "mean")     # options are keyword-only


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(device, reduction):
    logits = torch.randn(0, 50, device=device, requires_grad=True)
    target = torch.zeros(0, dtype=torch.long, device=device)
    loss = pykernels.cross_entropy(logits, target, reduction=reduction, backend="triton")
    assert loss.shape == ((0,) if reduction == "none" else ())
    assert torch.equal(loss.detach(), torch.zeros_like(loss))
    loss.sum().backward()
    assert logits.grad.shape == (0, 50)


def test_vector_logits(device):
    """(V,) logits with a 0-dim target, as torch accepts."""
    logits = torch.randn(40, device=device)
    target = torch.tensor(7, device=device)
    out = pykernels.cross_entropy(logits, target, backend="triton")
    torch.testing.assert_close(out, F.cross_entropy(logits, target))
    assert pykernels.cross_entropy(logits, target, backend="triton", reduction="none").shape == ()


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("V", [30522, 50257])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("label_smoothing,z_loss", [(0.0, 0.0), (0.1, 1e-4)])
def test_gpu_bf16(V, reduction, label_smoothing, z_loss):
    N = 4096
    logits = torch.randn(N, V, device="cuda", dtype=torch.bfloat16) * 3
    target = _targets(N, V, "cuda", ignore_frac=0.2)
    _check(logits, target, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss)


@pytest.mark.gpu
@pytest.mark.parametrize("N,V", [(8, 256000), (300, 1), (1000, 517), (3, 50257)])
def test_gpu_odd_shapes(N, V):
    logits = torch.randn(N, V, device="cuda", dtype=torch.bfloat16) * 2
    _check(logits, _targets(N, V, "cuda"), reduction="none", label_smoothing=0.1, z_loss=1e-4)
    _check(logits.float(), _targets(N, V, "cuda"))


@pytest.mark.gpu
def test_gpu_auto_uses_a_kernel_and_matches():
    # auto takes the CUDA C++ op for plain eager calls where the extension is built, else Triton: bitwise the
    # chosen backend's result, no fallback warning
    logits = torch.randn(2048, 50257, device="cuda", dtype=torch.bfloat16)
    target = _targets(2048, 50257, "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # no fallback on CUDA
        out = pykernels.cross_entropy(logits, target)
    chosen = "cuda" if cuda_built() else "triton"
    torch.testing.assert_close(out, pykernels.cross_entropy(logits, target, backend=chosen), rtol=0, atol=0)
    _check(logits, target, backend=None)


@pytest.mark.gpu
def test_gpu_float64_falls_back_with_warning(monkeypatch):
    import pykernels._backend as be
    # the warning is once per (op, reason) and process: a fresh record, whatever ran before in this worker
    # (run128: the float64 test above had already used it in the same xdist worker)
    monkeypatch.setattr(be, "_warned", set())
    logits = torch.randn(64, 1000, device="cuda", dtype=torch.float64)
    target = _targets(64, 1000, "cuda")
    with pytest.warns(FallbackWarning, match="float64"):
        out = pykernels.cross_entropy(logits, target, backend="auto")
    torch.testing.assert_close(out, cross_entropy_reference(logits, target))
    with pytest.raises(BackendUnavailableError, match="float64"):
        pykernels.cross_entropy(logits, target, backend="triton")


@pytest.mark.gpu
def test_gpu_strided_inplace_fp16_fp32():
    V = 50257
    buf = torch.randn(1024, V + 63, device="cuda", dtype=torch.float16)
    logits = buf[:, :V]
    target = _targets(1024, V, "cuda")
    _check(logits, target, label_smoothing=0.1)
    _check(torch.randn(512, 30522, device="cuda"), _targets(512, 30522, "cuda"), label_smoothing=0.1)
    base = torch.randn(2048, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = _targets(2048, V, "cuda")
    pykernels.cross_entropy(base * 1.0, target).backward()
    g_ref = base.grad
    base.grad = None
    logits = base * 1.0
    ptrs = []
    logits.register_hook(lambda g: ptrs.append(g.data_ptr()))
    pykernels.cross_entropy(logits, target, inplace_backward=True).backward()
    assert ptrs == [logits.data_ptr()]
    torch.testing.assert_close(base.grad, g_ref, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", [False, True])
def test_gpu_compile_inductor(inplace):
    logits = torch.randn(4096, 30522, device="cuda", dtype=torch.bfloat16)
    target = _targets(4096, 30522, "cuda")

    def f(x, t):
        return pykernels.cross_entropy(x * 1.0, t, label_smoothing=0.1, inplace_backward=inplace)

    upstream = torch.randn((), device="cuda")
    eager, g_eager = _loss_and_grad(f, logits, target, upstream)
    torch._dynamo.reset()
    compiled, g_comp = _loss_and_grad(torch.compile(f, fullgraph=True), logits, target, upstream)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(g_comp, g_eager)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda", marks=needs_cuda_ext)])
def test_gpu_int64_offsets(backend):
    """N * V > 2**31 elements: the last rows (whose offsets overflow int32) are right, forward and backward (the
    Triton kernels and the C++ op)."""
    V = 50257
    N = (2**31) // V + 64
    assert N * V > 2**31
    if torch.cuda.get_device_properties(0).total_memory < 3 * N * V * 2:
        pytest.skip("not enough GPU memory for two > 2**31-element bf16 tensors")
    logits = torch.randn(N, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, V, (N,), device="cuda")
    rows = pykernels.cross_entropy(logits, target, reduction="none", backend=backend)
    upstream = torch.randn(N, device="cuda")
    rows.backward(upstream.to(rows.dtype))
    tail = slice(N - 8, N)
    x_tail = logits.detach()[tail].double().requires_grad_()
    ref = cross_entropy_reference(x_tail, target[tail], reduction="none")
    ref.backward(upstream[tail].to(torch.bfloat16).double())
    torch.testing.assert_close(rows[tail].double(), ref.detach(), rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(logits.grad[tail].double(), x_tail.grad, rtol=1e-2, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# CUDA C++ backend (csrc/cross_entropy.cu): built on the GPU machine only
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("N,V", [(4096, 30522), (2048, 50257), (8, 256000), (300, 1), (1000, 517), (3, 17),
                                 (127, 1000), (1, 8)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cuda_backend(dtype, N, V, reduction):
    logits = torch.randn(N, V, device="cuda", dtype=dtype) * 3
    target = _targets(N, V, "cuda", ignore_frac=0.2)
    _check(logits, target, backend="cuda", reduction=reduction)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("label_smoothing,z_loss", [(0.1, 0.0), (0.0, 1e-2), (0.25, 1e-3), (1.0, 0.0)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cuda_backend_smoothing_and_z_loss(dtype, label_smoothing, z_loss, reduction):
    logits = torch.randn(777, 30522, device="cuda", dtype=dtype) * 2
    target = _targets(777, 30522, "cuda")
    _check(logits, target, backend="cuda", reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("V", [2, 3, 7, 8, 9, 136, 263, 8193])
def test_cuda_backend_row_alignments(V):
    """Rows at every offset modulo 16 bytes: heads, bodies and tails of every length; rows shorter than a pack."""
    for dtype in (torch.float16, torch.float32):
        logits = torch.randn(11, V, device="cuda", dtype=dtype) * 2
        _check(logits, _targets(11, V, "cuda"), backend="cuda", reduction="none", label_smoothing=0.1)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("offset,pad", [(8, 16), (8, 9), (3, 8)])
def test_cuda_backend_padded_buffers_and_in_place(offset, pad):
    """Slices of a padded fp16 buffer (aligned or not, row strides congruent to V modulo 8 elements or not:
    the backward's vector or element path), and the gradient written over them in place, bitwise the
    out-of-place one, with the padding untouched."""
    _padded_buffer_case("cuda", 1201, offset, pad, "cuda")


@pytest.mark.gpu
@needs_cuda_ext
def test_cuda_backend_inplace_and_saved_logits():
    base = torch.randn(64, 50257, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = _targets(64, 50257, "cuda")
    pykernels.cross_entropy(base * 2, target, backend="cuda", label_smoothing=0.1).backward()
    g_ref = base.grad.clone()
    base.grad = None
    logits = base * 2
    ptrs = []
    logits.register_hook(lambda g: ptrs.append(g.data_ptr()))
    pykernels.cross_entropy(logits, target, backend="cuda", label_smoothing=0.1, inplace_backward=True).backward()
    assert ptrs == [logits.data_ptr()]
    torch.testing.assert_close(base.grad, g_ref, rtol=0, atol=0)
    # another op saved the logits (and runs its backward after the loss's): overwriting them is an autograd
    # error, not a silent wrong gradient
    logits = base * 1.0
    other = (logits * logits).sum()
    loss = pykernels.cross_entropy(logits, target, backend="cuda", inplace_backward=True) + other
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # by default the logits are left alone
    x = (base.detach() * 2).requires_grad_()
    before = x.detach().clone()
    pykernels.cross_entropy(x, target, backend="cuda").backward()
    assert torch.equal(x.detach(), before)


@pytest.mark.gpu
@needs_cuda_ext
def test_cuda_backend_ignored_num_valid_out_of_range_and_empty():
    V = 1000
    logits = torch.randn(50, V, device="cuda", requires_grad=True)
    none = torch.full((50,), -100, device="cuda")
    for reduction in ("mean", "sum", "none"):  # all ignored: 0 and zero gradients, never NaN
        loss = pykernels.cross_entropy(logits, none, backend="cuda", reduction=reduction)
        (g,) = torch.autograd.grad(loss.sum(), logits)
        assert torch.equal(loss.detach(), torch.zeros_like(loss)) and torch.equal(g, torch.zeros_like(g))
    target = _targets(50, V, "cuda")
    ref_sum = cross_entropy_reference(logits.detach().double(), target, reduction="sum")
    for nv in (7, torch.tensor(7.0, device="cuda"), 0):
        got = pykernels.cross_entropy(logits, target, backend="cuda", num_valid=nv)
        torch.testing.assert_close(got.double(), ref_sum / max(float(nv), 1.0), rtol=1e-5, atol=0)
    t5 = torch.where(target == -100, 5, target)  # a custom ignore_index
    _check(logits.detach(), t5, backend="cuda", ignore_index=5)
    for dt in (torch.int32, torch.int16):  # int32 read as is, smaller ints widened by the wrapper
        torch.testing.assert_close(pykernels.cross_entropy(logits, target.to(dt), backend="cuda", reduction="none"),
                                   pykernels.cross_entropy(logits, target, backend="cuda", reduction="none"))
    bad = torch.tensor([1, V, -100, 2, -1], device="cuda")
    x = torch.randn(5, V, device="cuda", requires_grad=True)
    rows = pykernels.cross_entropy(x, bad, backend="cuda", reduction="none")
    assert torch.isnan(rows[[1, 4]]).all() and torch.isfinite(rows[[0, 2, 3]]).all()
    rows.sum().backward()
    assert torch.isnan(x.grad[[1, 4]]).all() and torch.isfinite(x.grad[[0, 2, 3]]).all()
    for reduction in ("mean", "sum", "none"):
        e = torch.randn(0, V, device="cuda", requires_grad=True)
        loss = pykernels.cross_entropy(e, torch.zeros(0, dtype=torch.long, device="cuda"), backend="cuda",
                                       reduction=reduction)
        assert loss.shape == ((0,) if reduction == "none" else ()) and not loss.detach().any()
        loss.sum().backward()
        assert e.grad.shape == (0, V)


@pytest.mark.gpu
@needs_cuda_ext
def test_cuda_backend_routing():
    from pykernels.cross_entropy import _use_cuda
    x = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16)
    t = _targets(64, 1000, "cuda")
    assert _use_cuda(None, x, t, None) and _use_cuda("cuda", x, t, None)
    assert not _use_cuda("triton", x, t, None)
    with pytest.raises(BackendUnavailableError, match="float64"):
        pykernels.cross_entropy(x.double(), t, backend="cuda")
    # traced: the Triton custom op (a named cuda backend raises there, naming why)
    compiled = torch.compile(lambda a, b: pykernels.cross_entropy(a, b), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, t), pykernels.cross_entropy(x, t, backend="triton"))
    with pytest.raises(Exception, match="eager mode only"):
        torch.compile(lambda a, b: pykernels.cross_entropy(a, b, backend="cuda"), fullgraph=True,
                      backend="aot_eager")(x, t)
    # inside a CUDA-graph capture auto takes Triton (the capture records its kernels)
    g = torch.cuda.CUDAGraph()
    pykernels.cross_entropy(x, t)  # warm up the Triton path's autotuner and the caches outside the capture
    pykernels.cross_entropy(x, t, backend="triton")
    with torch.cuda.graph(g):
        assert not _use_cuda(None, x, t, None)
        out = pykernels.cross_entropy(x, t)
    g.replay()
    torch.testing.assert_close(out, pykernels.cross_entropy(x, t, backend="triton"), rtol=0, atol=0)


def test_cuda_cover_and_routing_rules(device):
    """The C++ op's cover and the routing rule, on any machine: what it declines and why; auto never takes it off a
    CUDA device or where the extension is missing; named, it raises with the reason."""
    from pykernels.cross_entropy import _cuda_cover, _use_cuda
    x = torch.randn(4, 10, device=device)
    t = torch.randint(0, 10, (4,), device=device)
    assert _cuda_cover(x, t, None) is None
    assert "float64" in _cuda_cover(x.double(), t, None)
    assert not _use_cuda(None, x, t, None) or device.type == "cuda"
    assert not _use_cuda("triton", x, t, None) and not _use_cuda("reference", x, t, None)
    if not pykernels.backends()["cuda"].available:
        assert not _use_cuda(None, x, t, None) and not _use_cuda("auto", x, t, None)
        with pytest.raises(BackendUnavailableError, match="pykernels._C is not built"):
            pykernels.cross_entropy(x, t, backend="cuda")
    with pykernels.use_backend("triton"):  # the default backend decides when none is named
        assert not _use_cuda(None, x, t, None)
