"""pykernels.layer_norm: fused dropout + residual add + LayerNorm / RMSNorm, forward and backward.

Every output and gradient is checked against the float64 reference by the three-way rule
(tests/utils.assert_close_to_ref). CPU: fp32/fp16 through the Triton interpreter, tiny shapes.
GPU (marked): bf16 and realistic sizes.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import pykernels
from pykernels import BackendUnavailableError, FallbackWarning
from pykernels._rng import new_seed
from pykernels.attention import dropout_rate
from pykernels.layer_norm import layer_norm_dropout_mask, layer_norm_reference

from utils import assert_close_to_ref, cuda_built, needs_cuda_ext

CPU_DTYPES = [torch.float32, torch.float16]


def _atol(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-3


def _make(shape, dtype, device, *, residual=True, weight=True, bias=True, res_dtype=None, param_dtype=None,
          strided=False):
    """Fresh random inputs (leaves, requires_grad). ``strided``: x and residual are column slices of wider
    tensors (row stride != N). ``param_dtype``: weight and bias dtype (default x's)."""
    n = shape[-1]

    def t(dt):
        if strided:
            wide = torch.randn(*shape[:-1], n + 37, dtype=dt, device=device)
            return wide[..., 5:5 + n].detach().requires_grad_()
        return torch.randn(*shape, dtype=dt, device=device, requires_grad=True)

    x = t(dtype)
    r = t(res_dtype or dtype) if residual else None
    pdt = param_dtype or dtype
    w = (1 + 0.5 * torch.randn(n, dtype=pdt, device=device)).requires_grad_() if weight else None
    b = (0.5 * torch.randn(n, dtype=pdt, device=device)).requires_grad_() if bias else None
    return x, r, w, b


def _grads(outs, upstream, inputs):
    loss = sum((o.float() * g.float()).sum() for o, g in zip(outs, upstream))
    present = [i for i in inputs if i is not None]
    got = torch.autograd.grad(loss, present)
    it = iter(got)
    return [next(it) if i is not None else None for i in inputs]


def _check(x, r, w, b, *, dropout_p=0.0, prenorm=False, residual_in_fp32=False, rms_norm=False, eps=1e-5,
           backend="triton", seed=1234):
    """Run the op and both references, compare every output and every gradient."""
    dtype = x.dtype
    kw = dict(prenorm=prenorm, residual_in_fp32=residual_in_fp32, rms_norm=rms_norm)
    mask = None
    if dropout_p > 0:
        torch.manual_seed(seed)
        mask = layer_norm_dropout_mask(new_seed(x.device), x.shape, dropout_p, x.device)
    torch.manual_seed(seed)  # the op draws the same seed
    out = pykernels.layer_norm(x, w, b, eps, residual=r, dropout_p=dropout_p, backend=backend, **kw)
    outs = list(out) if prenorm else [out]
    ref_lo = layer_norm_reference(x, w, b, eps, residual=r, dropout_mask=mask, dropout_p=dropout_p, **kw)
    ref_hi = layer_norm_reference(x, w, b, eps, residual=r, dropout_mask=mask, dropout_p=dropout_p,
                                  upcast=True, **kw)
    ref_lo = list(ref_lo) if prenorm else [ref_lo]
    ref_hi = list(ref_hi) if prenorm else [ref_hi]
    names = ["y", "s"]
    for name, o, hi, lo in zip(names, outs, ref_hi, ref_lo):
        assert o.dtype == lo.dtype, f"{name}: dtype {o.dtype} != {lo.dtype}"
        assert_close_to_ref(name, o, hi, lo, atol=_atol(dtype))
    assert outs[0].dtype == dtype and outs[0].shape == x.shape
    upstream = [torch.randn_like(o) for o in outs]
    inputs = [x, r, w, b]
    g = _grads(outs, upstream, inputs)
    g_lo = _grads(ref_lo, upstream, inputs)
    g_hi = _grads(ref_hi, upstream, inputs)
    for name, a, hi, lo in zip(["dx", "dresidual", "dweight", "dbias"], g, g_hi, g_lo):
        if a is None:
            continue
        assert a.dtype == lo.dtype
        # dweight/dbias sum over rows: allow their eager error scale (same rule, atol scaled by rows), and
        # their one rounding to the output dtype (a neighbour where the sum lies at a rounding boundary)
        sums = name in ("dweight", "dbias")
        rows = x.numel() // x.shape[-1] if sums else 1
        assert_close_to_ref(name, a, hi, lo, atol=_atol(dtype) * max(1, rows ** 0.5), ulp=sums)
    return outs


# ----------------------------------------------------------------------------------------------------
# CPU (interpreter): fp32 / fp16, tiny shapes
# ----------------------------------------------------------------------------------------------------
VARIANTS = {
    "post": dict(),
    "post_no_residual": dict(residual=False),
    "pre": dict(prenorm=True),
    "pre_no_residual": dict(prenorm=True, residual=False),
    "pre_residual_in_fp32": dict(prenorm=True, residual_in_fp32=True),
    "rms_post": dict(rms_norm=True),
    "rms_pre": dict(rms_norm=True, prenorm=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n", [64, 100, 1023])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_forward_backward(variant, n, dtype, device):
    v = dict(VARIANTS[variant])
    residual = v.pop("residual", True)
    x, r, w, b = _make((7, n), dtype, device, residual=residual)
    _check(x, r, w, b, **v)


@pytest.mark.parametrize("n", [1000, 5])
@pytest.mark.parametrize("weight,bias", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("rms_norm", [False, True])
def test_weight_bias_optional(n, weight, bias, rms_norm, device):
    x, r, w, b = _make((3, n), torch.float32, device, weight=weight, bias=bias)
    _check(x, r, w, b, rms_norm=rms_norm, prenorm=True)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_leading_dims_and_strided_rows(dtype, device):
    x, r, w, b = _make((2, 3, 2, 200), dtype, device, strided=True)
    assert x.stride(-2) != x.shape[-1]
    _check(x, r, w, b, prenorm=True)
    x, r, w, b = _make((2, 3, 200), dtype, device, strided=True)
    _check(x, r, w, b)


def test_non_contiguous_last_dim(device):
    xt = torch.randn(48, 6, device=device, requires_grad=True)
    x = xt.t()  # (6, 48), last-dim stride 6: copied to contiguous rows
    r = torch.randn(6, 48, device=device).t().contiguous().t().detach().requires_grad_()
    w = torch.randn(48, device=device, requires_grad=True)
    _check(x, r.detach().requires_grad_(), w, None)


@pytest.mark.parametrize("prenorm", [False, True])
def test_expanded_upstream_gradient(prenorm, device):
    """y.sum().backward() hands the backward an expanded (stride 0) gradient."""
    x, r, w, b = _make((4, 3, 80), torch.float32, device)
    out = pykernels.layer_norm(x, w, b, residual=r, prenorm=prenorm, backend="triton")
    loss = out[0].sum() + 3 * out[1].sum() if prenorm else out.sum()
    g = torch.autograd.grad(loss, (x, r, w, b))
    ref = layer_norm_reference(*(t.double() for t in (x, w, b)), residual=r.double(), prenorm=prenorm)
    loss_ref = ref[0].sum() + 3 * ref[1].sum() if prenorm else ref.sum()
    g_ref = torch.autograd.grad(loss_ref, (x, r, w, b))
    for a, e in zip(g, g_ref):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_mixed_residual_dtype(device):
    """Residual stream kept in fp32 while the branch is fp16 (the next layer of a residual_in_fp32 model)."""
    x, r, w, b = _make((5, 300), torch.float16, device, res_dtype=torch.float32)
    y, s = _check(x, r, w, b, prenorm=True)
    assert s.dtype == torch.float32
    x, r, w, b = _make((5, 300), torch.float16, device, res_dtype=torch.float32)
    _check(x, r, w, b)


@pytest.mark.parametrize("n", [9000, 20000])  # chunked backward (> 8192) / chunked forward too (> 16384)
@pytest.mark.parametrize("rms_norm", [False, True])
def test_wide_rows(n, rms_norm, device):
    x, r, w, b = _make((3, n), torch.float32, device)
    _check(x, r, w, b, rms_norm=rms_norm, prenorm=True)
    x, r, w, b = _make((2, n), torch.float32, device)
    _check(x, r, w, b, rms_norm=rms_norm, dropout_p=0.25)


def test_large_mean_rows(device):
    """Two-pass variance: rows with a large offset keep their precision."""
    x, r, w, b = _make((4, 256), torch.float32, device)
    with torch.no_grad():
        x += 1000.0
    _check(x, r, w, b)


def test_single_row_and_tiny_hidden(device):
    for shape in [(1, 64), (1, 1), (3, 2)]:
        x, r, w, b = _make(shape, torch.float32, device)
        _check(x, r, w, b, prenorm=True)


@pytest.mark.parametrize("block_m,progs_per_sm,prefetch", [(4, 2, False), (16, 1, True), (8, 8, False),
                                                             (2, 1, True)])
def test_gpu_tile_configs_on_interpreter(block_m, progs_per_sm, prefetch, device, monkeypatch):
    """The GPU config lists use multi-row tiles and several programs per SM, which the interpreter's
    single default config does not: run such tiles here (rows not a multiple of the tile; some
    persistent programs with no rows at all)."""
    import triton

    from pykernels._kernels import layer_norm as K
    monkeypatch.setattr(K, "_fwd_configs", lambda bn: [triton.Config({"BLOCK_M": block_m}, num_warps=1)])
    monkeypatch.setattr(K, "_bwd_configs", lambda bn: [triton.Config(
        {"BLOCK_M": block_m, "PROGS_PER_SM": progs_per_sm, "PREFETCH": prefetch}, num_warps=1)])
    K._fwd_tuned.cache_clear()
    K._bwd_tuned.cache_clear()
    try:
        for n, rows in [(100, 37), (48, 5)]:
            x, r, w, b = _make((rows, n), torch.float32, device)
            _check(x, r, w, b, prenorm=True)
            x, r, w, b = _make((rows, n), torch.float32, device)
            _check(x, r, w, b, dropout_p=0.2, rms_norm=True)
            x, r, w, b = _make((rows, n), torch.float32, device, residual=False, bias=False)
            _check(x, r, w, b)
    finally:
        K._fwd_tuned.cache_clear()
        K._bwd_tuned.cache_clear()


def test_zero_rows(device):
    x, r, w, b = _make((0, 3, 64), torch.float32, device)
    y, s = pykernels.layer_norm(x, w, b, residual=r, prenorm=True, backend="triton")
    assert y.shape == s.shape == x.shape
    gx, gr, gw, gb = torch.autograd.grad(y.sum() + s.sum(), (x, r, w, b))
    assert gx.shape == x.shape and gr.shape == r.shape
    assert torch.equal(gw, torch.zeros_like(w)) and torch.equal(gb, torch.zeros_like(b))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_prenorm_gradient_through_one_output_only(backend, device):
    """Pre-LN with only y or only s in the loss: the other output's gradient arrives as None (no zero
    tensor is built for it) and the result equals the eager formula."""
    _one_output_only(backend, device, (7, 96))


def _one_output_only(backend, device, shape):
    x, r, w, b = _make(shape, torch.float32, device)
    n = shape[-1]
    for use in ("y", "s"):
        y, s = pykernels.layer_norm(x, w, b, residual=r, prenorm=True, backend=backend)
        out = y if use == "y" else s
        up = torch.randn_like(out)
        got = torch.autograd.grad(out, (x, r, w, b), up, allow_unused=True)
        xs, rs, ws, bs = (t.detach().double().requires_grad_() for t in (x, r, w, b))
        s_ref = xs + rs
        ref_out = torch.nn.functional.layer_norm(s_ref, (n,), ws, bs, 1e-5) if use == "y" else s_ref
        want = torch.autograd.grad(ref_out, (xs, rs, ws, bs), up.double(), allow_unused=True)
        for name, g, e in zip("xrwb", got, want):
            if e is None:  # s does not depend on w, b: their gradient is zero (or absent)
                assert g is None or torch.count_nonzero(g) == 0, name
            else:
                torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-5, msg=f"{use}: d{name}")


# ---- dropout -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("rms_norm", [False, True])
def test_dropout_matches_reference_mask(dtype, prenorm, rms_norm, device):
    """The kernel's mask equals layer_norm_dropout_mask(seed) in forward, and the backward regenerates it."""
    x, r, w, b = _make((6, 130), dtype, device)
    _check(x, r, w, b, dropout_p=0.3, prenorm=prenorm, rms_norm=rms_norm)
    x, r, w, b = _make((6, 130), dtype, device, residual=False)
    _check(x, r, w, b, dropout_p=0.3, prenorm=True, rms_norm=rms_norm)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_rate(p, device):
    x = torch.randn(64, 256, device=device)
    _, s = pykernels.layer_norm(x, None, None, prenorm=True, dropout_p=p, backend="triton")
    kept = (s != 0).double().mean().item()
    n = x.numel()
    sd = (p * (1 - p) / n) ** 0.5
    assert abs(kept - (1 - p)) < 6 * sd, f"keep rate {kept:.4f}, expected {1 - p} +- {6 * sd:.4f}"
    kept_vals = s[s != 0]
    torch.testing.assert_close(kept_vals, (x * (1 / (1 - dropout_rate(p))))[s != 0])  # the realised rate's scale
    # the mask is not the same for every row (counter = element index, not column index)
    m = s != 0
    assert not (m == m[0]).all()


def _dropout_ln(x, r, w, b, p, backend, *, seed=None):
    """layer_norm with residual and dropout ``p``, after ``torch.manual_seed(seed)`` unless seed is None."""
    if seed is not None:
        torch.manual_seed(seed)
    return pykernels.layer_norm(x, w, b, residual=r, dropout_p=p, backend=backend)


def test_dropout_reproducible_and_fresh(device):
    x, r, w, b = _make((8, 128), torch.float32, device)
    y1 = _dropout_ln(x, r, w, b, 0.4, "triton", seed=7)
    y2 = _dropout_ln(x, r, w, b, 0.4, "triton", seed=7)
    y3 = _dropout_ln(x, r, w, b, 0.4, "triton")
    assert torch.equal(y1, y2)
    assert not torch.equal(y1, y3)


def _keep_kernel():
    """A kernel that writes ``dropout_keep``'s mask for a block of rows (a Triton jit function resolves the
    helper among its module's globals, so it is made here, at first use)."""
    global _KEEP_KERNEL, dropout_keep
    if _KEEP_KERNEL is None:
        import triton
        import triton.language as tl
        from pykernels._kernels._dropout import dropout_keep

        @triton.jit
        def keep_kernel(O, seed, row0, n_cols, p, ROWS: tl.constexpr, COLS: tl.constexpr):
            rows = row0 + tl.arange(0, ROWS).to(tl.int64)
            cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
            keep = dropout_keep(seed, 0, rows, cols, n_cols, p)
            offs = tl.arange(0, ROWS)[:, None] * n_cols + cols[None, :]
            tl.store(O + offs, keep.to(tl.int8), mask=cols[None, :] < n_cols)

        _KEEP_KERNEL = keep_kernel
    return _KEEP_KERNEL


_KEEP_KERNEL = None
dropout_keep = None


@pytest.mark.parametrize("width", [16, 4], ids=["8_columns_a_call", "narrow_tile"])
def test_dropout_mask_offsets_past_2_31(device, width):
    """The kernels' dropout_keep (interpreter on CPU, compiled on CUDA) equals its eager twin
    (layer_norm_dropout_mask / pykernels.attention.dropout_bits) at rows whose counters pass 2**32, for tiles
    of 8-column runs (a Philox call per 8 columns) and narrower ones (a call per element)."""
    import triton
    from pykernels.attention import dropout_bits, dropout_rate
    row0, n_cols, p = 3 * 2**29 + 5, 37, 0.3  # row0 * ceil(37 / 8) > 2**32
    out = torch.full((8, n_cols), -1, dtype=torch.int8, device=device)
    _keep_kernel()[(triton.cdiv(n_cols, width),)](out, 98765, row0, n_cols, dropout_rate(p), ROWS=8, COLS=width)
    want = dropout_bits(98765, row0 + torch.arange(8), n_cols, device) >= round(dropout_rate(p) * 65536)
    assert torch.equal(out.bool(), want) and (out >= 0).all()
    rate = 1 - want.float().mean().item()
    assert 0.15 < rate < 0.45


def test_reference_backend_same_dropout_mask(device):
    """backend="reference" draws the same mask as the kernel for the same torch seed."""
    x, r, w, b = _make((4, 96), torch.float32, device)
    y_t = _dropout_ln(x, r, w, b, 0.5, "triton", seed=3)
    y_r = _dropout_ln(x, r, w, b, 0.5, "reference", seed=3)
    torch.testing.assert_close(y_t, y_r, rtol=1e-5, atol=1e-5)


# ---- reference backend, gradcheck, compile -----------------------------------------------------------
@pytest.mark.parametrize("variant", ["post", "pre", "rms_pre", "pre_no_residual"])
def test_reference_backend(variant, device):
    v = dict(VARIANTS[variant])
    residual = v.pop("residual", True)
    x, r, w, b = _make((5, 77), torch.float32, device, residual=residual)
    _check(x, r, w, b, backend="reference", **v)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("rms_norm", [False, True])
def test_gradcheck_fp64(backend, rms_norm, device):
    """fp64 gradcheck of the custom op's analytic backward (the reference backend; the Triton path with
    fp32 inputs is covered by the reference comparisons, here it must refuse fp64). Built on the kernel
    device, so the refusal asserted is the dtype's, not the device's."""
    x, r, w, b = _make((3, 9), torch.float64, device)
    ds_fn = lambda x, r, w, b: pykernels.layer_norm(x, w, b, residual=r, prenorm=True, rms_norm=rms_norm,  # noqa: E731
                                                     backend=backend)
    if backend == "triton":
        with pytest.raises(BackendUnavailableError, match="float64"):
            ds_fn(x, r, w, b)
        return
    assert torch.autograd.gradcheck(ds_fn, (x, r, w, b))


@pytest.mark.parametrize("prenorm", [False, True])
def test_compile_fullgraph_matches_eager(prenorm, device):
    torch._dynamo.reset()
    x, r, w, b = _make((2, 5, 96), torch.float32, device)

    def f(x, r, w, b):
        out = pykernels.layer_norm(x, w, b, residual=r, prenorm=prenorm, backend="triton")
        return (out[0] * 2 + out[1]) if prenorm else out * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    ye = f(x, r, w, b)
    yc = compiled(x, r, w, b)
    torch.testing.assert_close(yc, ye, rtol=0, atol=0)
    g = torch.randn_like(ye)
    ge = torch.autograd.grad(ye, (x, r, w, b), g)
    gc = torch.autograd.grad(yc, (x, r, w, b), g)
    for a, c in zip(ge, gc):
        torch.testing.assert_close(c, a, rtol=0, atol=0)


def test_compile_with_dropout(device):
    torch._dynamo.reset()
    x, r, w, b = _make((4, 64), torch.float32, device)

    def f(x, r):
        return pykernels.layer_norm(x, w, b, residual=r, dropout_p=0.2, backend="triton")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(11)
    ye = f(x, r)
    torch.manual_seed(11)
    yc = compiled(x, r)
    torch.testing.assert_close(yc, ye, rtol=0, atol=0)


# ---- modules -----------------------------------------------------------------------------------------
def test_nn_layernorm_state_dict_compatible():
    ours = pykernels.nn.LayerNorm(32, eps=1e-6)
    theirs = torch.nn.LayerNorm(32, eps=1e-6)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 4, 32)
    torch.testing.assert_close(ours(x), theirs(x))
    with torch.no_grad():
        ours.weight.normal_()
    theirs.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(x), theirs(x))
    assert list(pykernels.nn.LayerNorm(8, bias=False).state_dict()) == list(
        torch.nn.LayerNorm(8, bias=False).state_dict())
    assert list(pykernels.nn.LayerNorm(8, elementwise_affine=False).state_dict()) == []


def test_nn_layernorm_residual_and_triton(device):
    m = pykernels.nn.LayerNorm(96).to(device)
    m.backend = "triton"
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    x, r = torch.randn(2, 3, 96, device=device), torch.randn(2, 3, 96, device=device)
    ref = torch.nn.functional.layer_norm(x + r, (96,), m.weight, m.bias, m.eps)
    torch.testing.assert_close(m(x, r), ref, rtol=1e-5, atol=1e-5)
    # multi-dim normalized_shape folds into one dim
    m2 = pykernels.nn.LayerNorm((4, 24)).to(device)
    m2.backend = "triton"
    x2 = torch.randn(3, 4, 24, device=device)
    torch.testing.assert_close(m2(x2), torch.nn.functional.layer_norm(x2, (4, 24), m2.weight, m2.bias),
                               rtol=1e-5, atol=1e-5)


def test_nn_rmsnorm():
    m = pykernels.nn.RMSNorm(64, eps=1e-6)
    theirs = torch.nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        theirs.weight.normal_()
    m.load_state_dict(theirs.state_dict())
    x, r = torch.randn(5, 64), torch.randn(5, 64)
    torch.testing.assert_close(m(x), theirs(x))
    torch.testing.assert_close(m(x, r), theirs(x + r))


def test_replace_layer_norms(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                torch.nn.Sequential(torch.nn.GELU(), torch.nn.LayerNorm(32, bias=False)),
                                torch.nn.Linear(32, 4)).to(device)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.normal_()
    x = torch.randn(6, 16, device=device)
    before = model(x)
    params_before = [p for p in model.parameters()]
    sd_keys = list(model.state_dict())
    out = pykernels.nn.replace_layer_norms(model)
    assert out is model
    assert type(model[1]) is pykernels.nn.LayerNorm and type(model[2][1]) is pykernels.nn.LayerNorm
    assert all(a is b for a, b in zip(model.parameters(), params_before))
    assert list(model.state_dict()) == sd_keys
    # auto: the reference on CPU, the Triton kernels on CUDA (fp32, a few ulp from eager)
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)
    with pykernels.use_backend("triton"):
        torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)


# ---- errors and backend choice -----------------------------------------------------------------------
def test_bad_inputs():
    x = torch.randn(4, 16)
    w = torch.randn(16)
    with pytest.raises(ValueError, match="weight"):
        pykernels.layer_norm(x, torch.randn(15))
    with pytest.raises(ValueError, match="bias"):
        pykernels.layer_norm(x, w, torch.randn(2, 16))
    with pytest.raises(ValueError, match="residual"):
        pykernels.layer_norm(x, w, residual=torch.randn(4, 15))
    with pytest.raises(TypeError, match="residual"):
        pykernels.layer_norm(x, w, residual=torch.randn(4, 16, dtype=torch.float16))
    with pytest.raises(TypeError, match="weight"):
        pykernels.layer_norm(x, w.half())
    with pytest.raises(TypeError, match="bias"):
        pykernels.layer_norm(x, w, torch.randn(16, dtype=torch.float64))
    with pytest.raises(TypeError, match="x"):
        pykernels.layer_norm(torch.ones(4, 16, dtype=torch.int32), None)
    with pytest.raises(TypeError, match="x"):
        pykernels.layer_norm([1.0, 2.0], None)
    with pytest.raises(ValueError, match="x"):
        pykernels.layer_norm(torch.randn(4, 0), None)
    with pytest.raises(ValueError, match="dropout_p"):
        pykernels.layer_norm(x, w, dropout_p=1.0)
    with pytest.raises(ValueError, match="eps"):
        pykernels.layer_norm(x, w, eps=-1.0)
    with pytest.raises(TypeError, match="prenorm"):
        pykernels.layer_norm(x, w, prenorm=1)
    with pytest.raises(ValueError, match="backend"):
        pykernels.layer_norm(x, w, backend="cudnn")
    with pytest.raises(BackendUnavailableError, match="cuda"):
        pykernels.layer_norm(x, w, backend="cuda")


def test_unsupported_dtype_triton_raises_auto_uses_reference(device):
    """float64 on the kernel device: explicit triton raises naming the dtype; auto runs the reference
    (on CUDA with a FallbackWarning naming float64, on CPU silently: auto never picks the interpreter)."""
    x = torch.randn(4, 16, dtype=torch.float64, device=device)
    with pytest.raises(BackendUnavailableError, match="float64"):
        pykernels.layer_norm(x, None, backend="triton")
    import pykernels._backend as be
    be._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = pykernels.layer_norm(x, None, backend="auto")
    fallbacks = [w for w in caught if issubclass(w.category, FallbackWarning)]
    if device.type == "cuda":
        assert len(fallbacks) == 1 and "float64" in str(fallbacks[0].message)
    else:
        assert fallbacks == []
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (16,)))


@pytest.mark.gpu
def test_device_mismatch_and_fallback_warning_gpu():
    x = torch.randn(4, 16, device="cuda")
    with pytest.raises(ValueError, match="weight"):
        pykernels.layer_norm(x, torch.randn(16))
    xd = torch.randn(4, 16, device="cuda", dtype=torch.float64)
    import pykernels._backend as be
    be._warned.clear()
    with pytest.warns(FallbackWarning, match="float64"):
        y = pykernels.layer_norm(xd, None, backend="auto")
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(xd, (16,)))


def test_device_mismatch_cpu_meta():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="residual"):
        pykernels.layer_norm(x, None, residual=torch.randn(4, 16, device="meta"))


# ----------------------------------------------------------------------------------------------------
# GPU: bf16, realistic sizes
# ----------------------------------------------------------------------------------------------------
# every variant at the BERT-base and GPT-2 XL sizes; one variant each at the odd / wide sizes (kept
# short: the GPU batch of the whole suite has a time budget, and each new width autotunes)
GPU_CASES = ([(s, v) for s in [(16384, 768), (4096, 1600)]
              for v in ["post", "pre", "pre_residual_in_fp32", "rms_pre", "rms_post", "post_no_residual"]]
             + [((2048, 1000), "post"), ((2048, 1023), "pre"), ((1024, 3000), "rms_pre"),
                ((1024, 5120), "pre_residual_in_fp32"), ((8192, 4096), "post"), ((16384, 1024), "pre"),
                ((64, 65536), "pre"), ((64, 65536), "post")])


@pytest.mark.gpu
@pytest.mark.parametrize("shape,variant", GPU_CASES, ids=[f"{m}x{n}-{v}" for (m, n), v in GPU_CASES])
def test_gpu_bf16(shape, variant):
    v = dict(VARIANTS[variant])
    residual = v.pop("residual", True)
    x, r, w, b = _make(shape, torch.bfloat16, "cuda", residual=residual)
    _check(x, r, w, b, **v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_dropout_and_strided(dtype):
    x, r, w, b = _make((4, 512, 768), dtype, "cuda", strided=True)
    _check(x, r, w, b, dropout_p=0.1, prenorm=True)
    x, r, w, b = _make((2048, 20000), dtype, "cuda")
    _check(x, r, w, b, dropout_p=0.1)


@pytest.mark.gpu
def test_gpu_auto_and_compile():
    x, r, w, b = _make((8, 128, 768), torch.bfloat16, "cuda")
    _check(x, r, w, b, backend="auto", prenorm=True)

    def f(x, r):  # the compiled graph holds the Triton custom op: compare with eager Triton, bitwise
        return pykernels.layer_norm(x, w, b, residual=r, prenorm=True, backend="triton")

    compiled = torch.compile(f, fullgraph=True)
    ye, se = f(x, r)
    yc, sc = compiled(x, r)
    torch.testing.assert_close(yc, ye, rtol=0, atol=0)
    torch.testing.assert_close(sc, se, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_int64_offsets():
    """A (M, N) problem with more than 2**31 elements: rows past the int32 range are right."""
    free, _ = torch.cuda.mem_get_info()
    n = 4096
    m = (2**31) // n + 64  # 2**31 + 64 * 4096 elements, 4.3 GB in bf16 each
    need = 5 * m * n * 2 + (1 << 30)
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free, have {free / 2**30:.1f}")
    x = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    r = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    y, s = pykernels.layer_norm(x, w, None, residual=r, prenorm=True, backend="triton")
    rows = torch.tensor([0, m // 2, m - 65, m - 2, m - 1], device="cuda")
    ref_lo = layer_norm_reference(x[rows], w, residual=r[rows], prenorm=True)
    ref_hi = layer_norm_reference(x[rows], w, residual=r[rows], prenorm=True, upcast=True)
    assert_close_to_ref("y", y[rows], ref_hi[0], ref_lo[0], atol=1e-2)
    assert_close_to_ref("s", s[rows], ref_hi[1], ref_lo[1], atol=1e-2)
    assert torch.isfinite(y[-1000:]).all()
    del y, s
    dy = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    from pykernels._kernels.layer_norm import layer_norm_bwd, layer_norm_fwd
    _, _, mean, rstd = layer_norm_fwd(x, w, None, r, eps=1e-5, seed=0, dropout_p=0.0, store_s=False,
                                      s_dtype=torch.bfloat16, rms_norm=False)
    dx, dres, dwb = layer_norm_bwd(dy, None, x, r, None, w, mean, rstd, has_bias=False, seed=0, dropout_p=0.0,
                                   store_dx=False, dres_dtype=torch.bfloat16, rms_norm=False,
                                   x_dtype=torch.bfloat16, w_dtype=torch.bfloat16, b_dtype=None)
    assert dwb.shape == (1, n) and torch.isfinite(dwb).all()
    xs = x[rows].double().requires_grad_()
    yr = layer_norm_reference(xs, w.double(), residual=r[rows].double(), upcast=True)
    (gx,) = torch.autograd.grad(yr, xs, dy[rows].double())
    err = (dres[rows].double() - gx).abs().max().item()
    assert err < 0.05 * gx.abs().max().item(), err


# ----------------------------------------------------------------------------------------------------
# CUDA C++ backend (csrc/layer_norm.cu): built on the GPU machine only
# ----------------------------------------------------------------------------------------------------

# rows of one warp (N <= 1024) and of one block (wider: 1032 .. 4096 here, 8192 for fp16/bf16 below)
CUDA_CASES = [((1, 8), "post"), ((17, 64), "pre"), ((1000, 768), "post"), ((1000, 768), "pre"),
              ((127, 1000), "rms_pre"), ((64, 1024), "rms_post"), ((300, 256), "post_no_residual"),
              ((300, 512), "pre_no_residual"), ((16384, 768), "post"), ((16384, 1024), "pre"),
              ((33, 1032), "post"), ((1024, 1600), "pre"), ((257, 3000), "rms_pre"), ((2048, 4096), "post"),
              ((100, 4096), "pre_no_residual")]


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,variant", CUDA_CASES, ids=[f"{m}x{n}-{v}" for (m, n), v in CUDA_CASES])
def test_cuda_backend(shape, variant, dtype):
    v = dict(VARIANTS[variant])
    residual = v.pop("residual", True)
    x, r, w, b = _make(shape, dtype, "cuda", residual=residual)
    _check(x, r, w, b, backend="cuda", **v)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,variant", [((1000, 768), "post"), ((1000, 768), "pre"), ((257, 1000), "rms_pre"),
                                           ((64, 1024), "pre"), ((64, 4096), "post"),
                                           ((64, 4096), "pre_no_residual"), ((64, 5120), "pre")])
def test_cuda_backend_dropout(shape, variant, dtype):
    """The mask is Triton's (the reference draws it with layer_norm_dropout_mask for the same seed). N = 5120: block
    rows of 3 packs a thread (fp16 / bf16); fp32 rows stop at 4096, so there 5120 must be declined by name."""
    if dtype == torch.float32 and shape[1] > 4096:
        x = torch.randn(shape, dtype=dtype, device="cuda")
        with pytest.raises(BackendUnavailableError, match="N = 5120"):
            pykernels.layer_norm(x, None, dropout_p=0.1, backend="cuda")
        return
    v = dict(VARIANTS[variant])
    residual = v.pop("residual", True)
    x, r, w, b = _make(shape, dtype, "cuda", residual=residual)
    _check(x, r, w, b, backend="cuda", dropout_p=0.1, **v)


@pytest.mark.gpu
@needs_cuda_ext
def test_cuda_backend_dropout_same_mask_as_triton():
    x, r, w, b = _make((512, 768), torch.bfloat16, "cuda")
    outs = []
    for backend in ("cuda", "triton"):
        torch.manual_seed(7)
        y, s = pykernels.layer_norm(x, w, b, residual=r, dropout_p=0.2, prenorm=True, backend=backend)
        outs.append(s)
    assert torch.equal(outs[0], outs[1])  # s = dropout(x) + r: the same mask, the same rounding


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["pre", "post", "rms_post"])
def test_cuda_backend_widest_rows(dtype, variant):
    v = dict(VARIANTS[variant])
    x, r, w, b = _make((300, 8192), dtype, "cuda")
    _check(x, r, w, b, backend="cuda", **v)
    _check(x, r, w, b, backend="cuda", dropout_p=0.1, **v)  # 32 elements per thread with the Philox registers


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("weight,bias", [(False, False), (True, False), (False, True)])
def test_cuda_backend_optional_params_strided_and_leading_dims(weight, bias):
    x, r, w, b = _make((4, 33, 768), torch.bfloat16, "cuda", weight=weight, bias=bias, strided=True)
    _check(x, r, w, b, backend="cuda", prenorm=True)
    _check(x, r, w, b, backend="cuda")


@pytest.mark.gpu
@needs_cuda_ext
def test_cuda_backend_one_output_and_frozen_params():
    """The C++ op's own autograd (csrc/layer_norm.cu): pre-LN with only y or only s in the loss (the other output's
    gradient stays undefined: no zeros tensor stands in for it), and frozen parameters (a weight or bias that needs no
    gradient gets none; with both frozen the parameter sums are skipped), against the float64 formula."""
    _one_output_only("cuda", "cuda", (300, 768))
    x, r, w, b = _make((300, 768), torch.float32, "cuda")
    for frozen in ("w", "b", "wb"):
        for prenorm in (False, True):
            xs = x.detach().clone().requires_grad_()
            ws = w.detach().clone().requires_grad_("w" not in frozen)
            bs = b.detach().clone().requires_grad_("b" not in frozen)
            out = pykernels.layer_norm(xs, ws, bs, residual=r.detach(), prenorm=prenorm, backend="cuda")
            y = out[0] if prenorm else out
            up = torch.randn_like(y)
            (y * up).sum().backward()
            xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
            yd = torch.nn.functional.layer_norm(xd + r.detach().double(), (768,), wd, bd, 1e-5)
            gx, gw, gb = torch.autograd.grad(yd, (xd, wd, bd), up.double())
            what = f"frozen {frozen}, prenorm {prenorm}"
            torch.testing.assert_close(xs.grad.double(), gx, rtol=1e-4, atol=1e-5, msg=what)
            for name, t, g in (("w", ws, gw), ("b", bs, gb)):
                if name in frozen:
                    assert t.grad is None, what
                else:
                    torch.testing.assert_close(t.grad.double(), g, rtol=1e-4, atol=1e-4, msg=f"{what}: d{name}")


def _compiled_code_and_results(f, inputs, upstream):
    """Compile ``f`` (inductor, fullgraph) and run it once, which compiles it (the generated code, forward and
    backward), then again from ``torch.manual_seed(11)``: (code, its outputs and the inputs' gradients)."""
    from torch._inductor.utils import run_and_get_code

    def run(fn):
        torch.manual_seed(11)
        outs = fn(*inputs)
        return [o.detach() for o in outs] + _grads(outs, upstream, inputs)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    _, code = run_and_get_code(run, compiled)
    return "\n".join(code), run(compiled)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("variant", ["post", "pre", "rms_pre", "pre_no_residual"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_gpu_compile_runs_the_cuda_pair(variant, dropout_p, param_dtype):
    """Under torch.compile, auto runs the C++ kernels through their compiled pair (pykernels_cuda::layer_norm_fwd and
    layer_norm_bwd, called by the graph with no Python between): the generated code holds them and not the Triton
    custom op, and outputs and gradients equal the eager C++ op's bit for bit (the forward draws the seed as the
    eager op does: one torch.manual_seed, one dropout mask). Strided rows, leading dims, fp32 parameters."""
    v = dict(VARIANTS[variant])
    residual = v.pop("residual", True)
    prenorm = v.get("prenorm", False)
    x, r, w, b = _make((4, 100, 768), torch.bfloat16, "cuda", residual=residual, param_dtype=param_dtype,
                       strided=True)

    def f(x, r, w, b, backend=None):
        out = pykernels.layer_norm(x, w, b, residual=r, dropout_p=dropout_p, backend=backend, **v)
        return out if prenorm else (out,)

    upstream = [torch.randn_like(o) for o in f(x, r, w, b, backend="cuda")]
    code, got = _compiled_code_and_results(f, (x, r, w, b), upstream)
    assert "pykernels_cuda.layer_norm_fwd" in code and "pykernels_cuda.layer_norm_bwd" in code
    assert "pykernels.layer_norm_fwd" not in code
    torch.manual_seed(11)
    outs = f(x, r, w, b, backend="cuda")
    want = [o.detach() for o in outs] + _grads(outs, upstream, (x, r, w, b))
    assert len(got) == len(want)
    for i, (g, e) in enumerate(zip(got, want)):
        assert (g is None) == (e is None), i
        if e is not None:
            assert g.dtype == e.dtype and g.shape == e.shape, i
            assert torch.equal(g, e), i


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_compile_follows_use_backend():
    """The compiled routing is decided when dynamo traces: a compiled function called inside use_backend("triton")
    is traced again (dynamo guards on the block's backend) and runs the Triton custom op; named "cuda" the pair,
    with dropout too; a call the C++ kernels do not cover (N = 1004) raises when named, under compile as eagerly."""
    x, r, w, b = _make((64, 768), torch.bfloat16, "cuda")
    upstream = [torch.randn_like(x)]

    def f(x, r, w, b):
        return (pykernels.layer_norm(x, w, b, residual=r),)

    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    run = lambda: _grads(compiled(x, r, w, b), upstream, (x, r, w, b))  # noqa: E731
    _, code = run_and_get_code(run)
    assert "pykernels_cuda.layer_norm_fwd" in "\n".join(code)
    with pykernels.use_backend("triton"):
        _, code = run_and_get_code(run)
    code = "\n".join(code)
    assert "pykernels.layer_norm_fwd" in code and "pykernels_cuda" not in code
    xn = torch.randn(8, 1004, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(Exception, match="N = "):
        torch.compile(lambda t: pykernels.layer_norm(t, None, backend="cuda"))(xn)


@pytest.mark.gpu
@needs_cuda_ext
def test_cuda_backend_is_auto_and_declines_what_it_does_not_cover():
    from pykernels.layer_norm import _use_cuda
    x, r, w, b = _make((64, 768), torch.bfloat16, "cuda")
    assert _use_cuda(None, x, w, b, r, 0.0, False)  # auto takes it, with dropout too
    assert _use_cuda(None, x, w, b, r, 0.1, False)
    assert not _use_cuda("triton", x, w, b, r, 0.0, False)
    assert not _use_cuda(None, x, w, b, r, 0.0, True)  # residual_in_fp32: auto goes to Triton, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pykernels.layer_norm(x, w, b, residual=r, prenorm=True, residual_in_fp32=True)
    with pytest.raises(BackendUnavailableError, match="residual_in_fp32"):
        pykernels.layer_norm(x, w, b, residual=r, backend="cuda", prenorm=True, residual_in_fp32=True)
    # not a multiple of the pack / wider than the widest row: Triton under auto, raise when named
    for n, dt in ((1004, torch.bfloat16), (8200, torch.bfloat16), (4100, torch.float32), (8192, torch.float32)):
        xn = torch.randn(8, n, device="cuda", dtype=dt)
        assert not _use_cuda(None, xn, None, None, None, 0.0, False)
        with pytest.raises(BackendUnavailableError, match="N = "):
            pykernels.layer_norm(xn, None, backend="cuda")
    assert _use_cuda(None, x, w.float(), b.float(), r, 0.1, False)  # fp32 parameters (autocast's)
    with pytest.raises(BackendUnavailableError, match="residual has another dtype"):
        pykernels.layer_norm(x, w, b, residual=r.float(), backend="cuda")


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,variant", [((1000, 768), "post"), ((1000, 768), "pre"), ((64, 1024), "rms_post"),
                                           ((64, 1024), "pre"), ((257, 4096), "post"), ((33, 8192), "pre"),
                                           ((300, 256), "pre_no_residual")])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_cuda_backend_fp32_params(shape, variant, dtype, dropout_p):
    """Autocast's case: bf16 / fp16 rows with fp32 weight and bias, in every row shape of the kernels (warp, pair
    and block rows); dweight / dbias come back fp32, as the parameters are."""
    v = dict(VARIANTS[variant])
    residual = v.pop("residual", True)
    x, r, w, b = _make(shape, dtype, "cuda", residual=residual, param_dtype=torch.float32)
    _check(x, r, w, b, backend="cuda", dropout_p=dropout_p, **v)
    x, r, w, b = _make(shape, dtype, "cuda", residual=residual, param_dtype=torch.float32, weight=False)
    _check(x, r, w, b, backend="cuda", dropout_p=dropout_p, **v)  # bias alone sets the parameters' dtype


@pytest.mark.gpu
@needs_cuda_ext
def test_cuda_backend_int64_offsets():
    """The C++ op on more than 2**31 elements (block rows, N = 4096): rows past the int32 range are right,
    forward and backward (the gradient through y only: no ds)."""
    free, _ = torch.cuda.mem_get_info()
    n = 4096
    m = (2**31) // n + 64
    need = 7 * m * n * 2 + (1 << 30)
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free, have {free / 2**30:.1f}")
    x = torch.randn(m, n, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    r = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    y, s = pykernels.layer_norm(x, w, None, residual=r, prenorm=True, backend="cuda")
    rows = torch.tensor([0, m // 2, m - 65, m - 2, m - 1], device="cuda")
    xr = x.detach()[rows]
    ref_lo = layer_norm_reference(xr, w, residual=r[rows], prenorm=True)
    ref_hi = layer_norm_reference(xr, w, residual=r[rows], prenorm=True, upcast=True)
    assert_close_to_ref("y", y.detach()[rows], ref_hi[0], ref_lo[0], atol=1e-2)
    assert_close_to_ref("s", s.detach()[rows], ref_hi[1], ref_lo[1], atol=1e-2)
    dy = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    (dx,) = torch.autograd.grad(y, x, dy)
    del y, s
    xs = xr.double().requires_grad_()
    yr = layer_norm_reference(xs, w.double(), residual=r[rows].double(), upcast=True)
    (gx,) = torch.autograd.grad(yr, xs, dy[rows].double())
    err = (dx[rows].double() - gx).abs().max().item()
    assert err < 0.05 * gx.abs().max().item(), err
    assert torch.isfinite(dx[-1000:]).all()


@pytest.mark.gpu
@needs_cuda_ext
def test_cuda_backend_auto_takes_cuda_inside_graph_capture():
    # captured, auto takes the C++ op as eagerly (its kernels read the dropout seed from device memory, and are
    # faster than Triton's on the GPU at most shapes): the same kernels as the eager warm-up before a capture
    from pykernels.layer_norm import _use_cuda
    x, r, w, b = _make((64, 1024), torch.bfloat16, "cuda")
    pykernels.layer_norm(x, w, b, residual=r, prenorm=True, backend="triton")  # compiled outside the capture
    pykernels.layer_norm(x, w, b, residual=r, prenorm=True, backend="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chosen = (_use_cuda(None, x, w, b, r, 0.0, False), _use_cuda("cuda", x, w, b, r, 0.0, False),
                  _use_cuda("triton", x, w, b, r, 0.0, False))
        y, s = pykernels.layer_norm(x, w, b, residual=r, prenorm=True)
        y_c, s_c = pykernels.layer_norm(x, w, b, residual=r, prenorm=True, backend="triton")
    g.replay()
    torch.cuda.synchronize()
    assert chosen == (True, True, False)
    assert _use_cuda(None, x, w, b, r, 0.0, False)  # and eager again after the capture
    y_e, s_e = pykernels.layer_norm(x, w, b, residual=r, prenorm=True, backend="cuda")
    y_t, s_t = pykernels.layer_norm(x, w, b, residual=r, prenorm=True, backend="triton")
    assert torch.equal(y, y_e) and torch.equal(s, s_e)
    assert torch.equal(y_c, y_t) and torch.equal(s_c, s_t)


@pytest.mark.gpu
@needs_cuda_ext
def test_cuda_backend_grad_only_through_s_and_no_grad():
    x, r, w, b = _make((256, 768), torch.bfloat16, "cuda")
    y, s = pykernels.layer_norm(x, w, b, residual=r, prenorm=True, backend="cuda")
    (s.float() * 2).sum().backward()  # y unused: its gradient is zero
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    torch.testing.assert_close(r.grad, torch.full_like(r, 2.0))
    assert w.grad.abs().max().item() == 0.0 and b.grad.abs().max().item() == 0.0
    with torch.no_grad():
        y2 = pykernels.layer_norm(x, w, b, residual=r, backend="cuda")
    ref = layer_norm_reference(x.detach(), w.detach(), b.detach(), residual=r.detach(), upcast=True)
    assert not y2.requires_grad
    assert (y2.float() - ref.float()).abs().max().item() < 0.05


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("n", [768, 1024, 4096])  # backward rows of one warp, two warps, one block
def test_cuda_backend_deterministic(n):
    x, r, w, b = _make((4099, n), torch.bfloat16, "cuda")
    g = torch.randn(4099, n, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        y = pykernels.layer_norm(x, w, b, residual=r, backend="cuda")
        runs.append(torch.autograd.grad(y, (x, w, b), g))
    for a, c in zip(*runs):
        assert torch.equal(a, c)


# The persistent forward (csrc/layer_norm.cu ln_fwd_persist_kernel: fp16 / bf16 warp rows of <= 2 packs a lane,
# N <= 512): rows fewer than its grid (warps with no row), several rows a warp with a ragged tail, both row shapes it
# takes (1, 2 packs a lane), dropout on and off, parameters of x's dtype and fp32; and rows it leaves to the one-row
# grid (3 packs, fp32 rows), which the switch must not change either.
PERSIST_CASES = [((3, 512), "pre", torch.bfloat16, None, 0.1),
                 ((20003, 512), "post", torch.bfloat16, torch.float32, 0.1),
                 ((16384, 504), "rms_pre", torch.float16, None, 0.0),
                 ((3, 768), "pre", torch.bfloat16, None, 0.1),
                 ((20003, 768), "post", torch.bfloat16, None, 0.1),
                 ((20003, 768), "pre", torch.bfloat16, torch.float32, 0.1),
                 ((16384, 768), "post", torch.bfloat16, torch.float32, 0.0),
                 ((9001, 520), "rms_pre", torch.float16, None, 0.0),
                 ((40001, 256), "post_no_residual", torch.bfloat16, None, 0.1),
                 ((5003, 384), "post", torch.float32, None, 0.1),
                 ((5003, 136), "pre", torch.float32, None, 0.0)]
PERSIST_IDS = [f"{m}x{n}-{v}-{str(d)[6:]}-w{'32' if p else 'x'}-p{q}" for (m, n), v, d, p, q in PERSIST_CASES]


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("shape,variant,dtype,pdt,dropout_p", PERSIST_CASES, ids=PERSIST_IDS)
def test_cuda_backend_persistent_forward(shape, variant, dtype, pdt, dropout_p):
    v = dict(VARIANTS[variant])
    residual = v.pop("residual", True)
    x, r, w, b = _make(shape, dtype, "cuda", residual=residual, param_dtype=pdt)
    _check(x, r, w, b, backend="cuda", dropout_p=dropout_p, **v)


@pytest.mark.gpu
@needs_cuda_ext
def test_cuda_backend_persistent_forward_equals_one_row_grid(tmp_path):
    """PYKERNELS_LN_FWD_PERSIST=0 (read once by the extension, so in a second process) takes the one-row-a-warp forward:
    its y, s, mean and rstd, dropout masks included, must equal the persistent forward's bit for bit."""
    import os
    import subprocess
    import sys

    import pykernels._C  # noqa: F401  (registers torch.ops.pykernels_cuda)
    if os.environ.get("PYKERNELS_LN_FWD_PERSIST") == "0":
        pytest.skip("the persistent forward is switched off in this process")
    cases = []
    for (m, n), variant, dtype, pdt, p in PERSIST_CASES:
        v = dict(VARIANTS[variant])
        residual = v.pop("residual", True)
        x, r, w, b = (t.detach() if t is not None else None
                      for t in _make((m, n), dtype, "cuda", residual=residual, param_dtype=pdt))
        cases.append(dict(x=x, r=r, w=w, b=b, p=p, prenorm=v.get("prenorm", False), rms=v.get("rms_norm", False)))
    inputs = tmp_path / "inputs.pt"
    torch.save(cases, inputs)

    def run(path_in, path_out):
        outs = []
        for i, c in enumerate(torch.load(path_in)):
            torch.manual_seed(1000 + i)  # draw_seed: the same dropout seed in both processes
            outs.append([t.cpu() for t in torch.ops.pykernels_cuda.layer_norm_fwd(
                c["x"], c["w"], c["b"], c["r"], 1e-5, c["p"], c["prenorm"], c["rms"])])
        torch.save(outs, path_out)

    src = ("import sys, torch\n"
           "import pykernels._C  # registers torch.ops.pykernels_cuda\n"
           f"{_source_of(run)}\n"
           "run(sys.argv[1], sys.argv[2])\n")
    env = dict(os.environ, PYKERNELS_LN_FWD_PERSIST="0",
               PYTHONPATH=os.pathsep.join([p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]))
    off = tmp_path / "off.pt"
    res = subprocess.run([sys.executable, "-c", src, str(inputs), str(off)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    on = tmp_path / "on.pt"
    run(inputs, on)
    for case, a, c in zip(PERSIST_CASES, torch.load(on), torch.load(off)):
        for name, ta, tc in zip(["y", "s", "mean", "rstd", "seed"], a, c):
            assert torch.equal(ta, tc), f"{case}: {name} differs between the persistent and the one-row forward"


def _source_of(fn) -> str:
    """fn's source, dedented (a nested function run again in a subprocess)."""
    import inspect
    import textwrap
    return textwrap.dedent(inspect.getsource(fn))


@pytest.mark.gpu
@needs_cuda_ext
def test_cuda_backend_misaligned_contiguous_view():
    """A contiguous view starting 2 bytes past an aligned address (the kernels load 16-byte packs)."""
    base = torch.randn(64 * 768 + 8, device="cuda", dtype=torch.bfloat16)
    x = base[1:1 + 64 * 768].view(64, 768).detach().requires_grad_()
    _, r, w, b = _make((64, 768), torch.bfloat16, "cuda")
    _check(x, r, w, b, backend="cuda")
    _check(x, r, w, b, backend="cuda", prenorm=True)



def test_cuda_cover_reasons_cpu():
    """What the CUDA C++ op covers is decided in Python before any extension is needed."""
    from pykernels.layer_norm import _cuda_cover
    bf, f32 = torch.bfloat16, torch.float32
    x = torch.randn(4, 768, dtype=bf)
    w = torch.randn(768, dtype=bf)
    assert _cuda_cover(x, w, w, x, 0.0, False) is None
    assert _cuda_cover(torch.randn(4, 8192, dtype=bf), None, None, None, 0.0, False) is None
    assert _cuda_cover(torch.randn(4, 4096, dtype=f32), None, None, None, 0.0, False) is None
    assert _cuda_cover(x, w, None, None, 0.1, False) is None  # dropout: the same Philox stream as Triton
    assert _cuda_cover(x, w.float(), w.float(), x, 0.1, False) is None  # fp32 parameters (autocast's)
    assert _cuda_cover(x, None, w.float(), None, 0.0, False) is None
    assert "weight" in _cuda_cover(x, w.half(), None, None, 0.0, False)
    assert "weight" in _cuda_cover(x.float(), w, None, None, 0.0, False)  # fp32 rows take fp32 parameters only
    assert "residual" in _cuda_cover(x, None, None, x.float(), 0.0, False)
    assert "residual_in_fp32" in _cuda_cover(x, None, None, x, 0.0, True)
    assert "float64" in _cuda_cover(x.double(), None, None, None, 0.0, False)
    for n, dt in ((1004, bf), (8200, bf), (4100, f32), (8192, f32), (6, f32)):
        assert "N = " in _cuda_cover(torch.randn(2, n, dtype=dt), None, None, None, 0.0, False), (n, dt)
    with torch.device("meta"):
        xm = torch.empty(4, 768, dtype=bf)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        xf = mode.from_tensor(x)
    assert "torch.compile" in _cuda_cover(xf, None, None, None, 0.0, False)
    assert _cuda_cover(xm, None, None, None, 0.0, False) is None  # (device is checked by the caller)


@pytest.mark.parametrize("backend", ["triton"] + (["cuda"] if torch.cuda.is_available() and cuda_built() else []))
def test_double_backward_raises_never_silent(backend, device):
    """create_graph=True, then a second backward through the op's backward: a clear error, never a
    second-order gradient that is silently zero."""
    device = torch.device("cuda") if backend == "cuda" else device
    x, r, w, b = _make((4, 64), torch.float32, device)
    y = pykernels.layer_norm(x, w, b, residual=r, backend=backend)
    if backend == "cuda":  # the C++ backward refuses create_graph at once
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad((y * y).sum(), x, create_graph=True)
    else:  # the Triton backward op records a node that raises when reached
        (gx,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="no autograd formula"):
            gx.sum().backward()
    y = pykernels.layer_norm(x, w, b, residual=r, backend=backend)  # without create_graph: fine
    (g1,) = torch.autograd.grad((y * y).sum(), x)
    assert torch.isfinite(g1).all()


# (shape, variant, dtype, param dtype, dropout_p, weight, bias): fp16 / bf16 rows of 3-4 packs a lane, odd row counts
ROWS_CASES = [((16389, 768), "pre", torch.bfloat16, None, 0.0, True, True),
              ((1001, 1024), "post", torch.float16, None, 0.1, True, True),
              ((3, 520), "rms_pre", torch.bfloat16, torch.float32, 0.0, True, False),
              ((2049, 1000), "post_no_residual", torch.bfloat16, None, 0.2, False, True),
              ((1, 768), "post", torch.bfloat16, torch.float32, 0.1, True, True)]


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("case", ROWS_CASES, ids=lambda c: f"{c[0][0]}x{c[0][1]}-{c[1]}-{c[4]}")
def test_gpu_cuda_forward_rows_kernel(case, monkeypatch):
    """fp16 / bf16 rows of 3-4 packs a lane take ln_fwd_rows_kernel (two warps a block, late weights), which the
    profiler names; PYKERNELS_LN_FWD_ROWS=0 takes ln_fwd_kernel. Both run ln_fwd_row, so the outputs (and the dropout
    mask, drawn from the same seed) are bitwise equal; the rows kernel also passes the references' rule."""
    from torch.profiler import ProfilerActivity, profile
    shape, variant, dtype, pdt, p, weight, bias = case
    v = dict(VARIANTS[variant])
    residual = v.pop("residual", True)
    x, r, w, b = _make(shape, dtype, "cuda", residual=residual, param_dtype=pdt, weight=weight, bias=bias)
    _check(x, r, w, b, backend="cuda", dropout_p=p, **v)
    outs = []
    for setting in ("1", "0"):
        monkeypatch.setenv("PYKERNELS_LN_FWD_ROWS", setting)
        torch.manual_seed(3)
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = pykernels.layer_norm(x, w, b, residual=r, dropout_p=p, backend="cuda", **v)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if "ln_fwd" in e.name]
        assert names and all(("ln_fwd_rows_kernel" in n) == (setting == "1") for n in names), names
        outs.append(out if isinstance(out, tuple) else (out,))
    for a, c in zip(*outs):
        assert torch.equal(a, c)


# (shape, variant, dtype, param dtype, dropout_p, offset): fp16 / bf16 backward rows of one warp, two warps and one
# block; offset shifts x (a mean far from 0 against a std of about 1: the fused math's constant carries mean x rstd)
FMA_CASES = [((16389, 768), "pre", torch.bfloat16, None, 0.0, 0.0),
             ((4099, 1024), "post", torch.float16, torch.float32, 0.1, 0.0),
             ((2053, 4096), "pre", torch.bfloat16, None, 0.0, 0.0),
             ((1001, 256), "rms_post", torch.bfloat16, None, 0.1, 0.0),
             ((777, 768), "post", torch.bfloat16, None, 0.0, 200.0),
             ((513, 8192), "pre_no_residual", torch.float16, None, 0.0, 30.0)]


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("case", FMA_CASES, ids=lambda c: f"{c[0][0]}x{c[0][1]}-{c[1]}-{c[4]}-off{c[5]:g}")
def test_gpu_cuda_backward_fused_math(case, monkeypatch):
    """The fp16 / bf16 backward's row math in fused multiply-adds (ln_bwd_kernel<..., FM = true>, the profiler's last
    template argument) and without (PYKERNELS_LN_BWD_FMA=0): both pass the references' rule, also with a mean far from
    0, and agree within fp32 rounding."""
    import re

    from torch.profiler import ProfilerActivity, profile
    shape, variant, dtype, pdt, p, offset = case
    v = dict(VARIANTS[variant])
    residual = v.pop("residual", True)
    x, r, w, b = _make(shape, dtype, "cuda", residual=residual, param_dtype=pdt)
    with torch.no_grad():
        x += offset
    leaves = [t for t in (x, r, w, b) if t is not None]
    results = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("PYKERNELS_LN_BWD_FMA", setting)
        _check(x, r, w, b, backend="cuda", dropout_p=p, **v)
        torch.manual_seed(5)
        out = pykernels.layer_norm(x, w, b, residual=r, dropout_p=p, backend="cuda", **v)
        outs = out if isinstance(out, tuple) else (out,)
        torch.manual_seed(6)
        ups = [torch.randn_like(o) for o in outs]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            results[setting] = torch.autograd.grad(outs, leaves, ups)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if "ln_bwd_kernel" in e.name]
        assert names
        for n in names:
            last = re.search(r"ln_bwd_kernel<.*, (true|false)>", n)
            assert last is not None and (last.group(1) == "true") == (setting == "1"), (setting, n)
    for a, c in zip(results["1"], results["0"]):
        torch.testing.assert_close(a.float(), c.float(), rtol=2e-2, atol=2e-2 * c.float().abs().max().item() + 1e-3)


# (shape, variant, dtype, param dtype): the backward's dweight / dbias partial sums. 20000 x 64: rows of one warp,
# eight row groups a block (the other cases of at most 1024 columns: two warps, four groups); 16389 rows leave the last
# groups a row short; block rows (N > 1024, whose partial rows are thread-major under the slots: 3000 columns leave
# positions past N unwritten) and a single row.
SUM_CASES = [((16384, 768), "pre", torch.bfloat16, None),
             ((16389, 768), "post", torch.bfloat16, torch.float32),
             ((20000, 64), "pre", torch.float16, None),
             ((2051, 4096), "rms_post", torch.bfloat16, None),
             ((1031, 3000), "pre", torch.bfloat16, torch.float32),
             ((257, 8192), "post", torch.float16, None),
             ((515, 2048), "pre", torch.float32, None),
             ((1, 1024), "post", torch.float32, None)]


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("case", SUM_CASES, ids=lambda c: f"{c[0][0]}x{c[0][1]}-{c[1]}-{str(c[2])[6:]}")
def test_gpu_cuda_backward_partial_sums(case, monkeypatch):
    """dweight / dbias from the backward's per-block partial sums, reduced by ln_partial_sum_kernel (the profiler sees
    it run), pass the references' rule and are bitwise reproducible call to call; the block sums by slots (default)
    and by turns (PYKERNELS_LN_BWD_SLOTS=0) add in the same order, so every gradient is bitwise the same (block rows:
    the partial rows thread-major or in column order)."""
    from torch.profiler import ProfilerActivity, profile
    shape, variant, dtype, pdt = case
    v = dict(VARIANTS[variant])
    residual = v.pop("residual", True)
    x, r, w, b = _make(shape, dtype, "cuda", residual=residual, param_dtype=pdt)
    leaves = [t for t in (x, r, w, b) if t is not None]
    grads = []
    for setting in ("1", "1", "0"):
        monkeypatch.setenv("PYKERNELS_LN_BWD_SLOTS", setting)
        if setting == "1" and not grads:
            _check(x, r, w, b, backend="cuda", **v)
        out = pykernels.layer_norm(x, w, b, residual=r, backend="cuda", **v)
        outs = out if isinstance(out, tuple) else (out,)
        torch.manual_seed(6)
        ups = [torch.randn_like(o) for o in outs]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            grads.append(torch.autograd.grad(outs, leaves, ups))
            torch.cuda.synchronize()
        assert any("ln_partial_sum_kernel" in e.name for e in prof.events())
    for other in grads[1:]:
        for a, c in zip(grads[0], other):
            assert torch.equal(a, c)
