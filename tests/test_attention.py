"""Tests of pykernels.scaled_dot_product_attention / varlen_attention / unpad_input / pad_input.

CPU (Triton interpreter, fp32/fp16, tiny shapes, backend="triton"): forward and all three gradients
against a float64 reference with the three-way rule (tests/utils.py), causal alignment vs torch,
masks (key padding, boolean, additive, broadcast), GQA/MQA, Sq != Sk, odd lengths, fully masked rows,
dropout (exact mask agreement, keep rate, seeding), determinism, torch.compile, strided inputs,
varlen vs padded, backends and input errors. GPU (``@pytest.mark.gpu``): bf16, realistic shapes.
"""
from __future__ import annotations

import math

import pytest
import torch

import pykernels
from pykernels import BackendUnavailableError, FallbackWarning
from pykernels._rng import new_seed
from pykernels.attention import (PHILOX_ROUNDS, attention_dropout_mask, attention_reference, pad_input, philox4x32,
                                 scaled_dot_product_attention as sdpa, unpad_input, varlen_attention)
from utils import assert_close_to_ref, needs_cuda_ext

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Interpreter-sized matrix tests: on a GPU machine they would compile ~100 kernel variants (minutes of
# Triton compile time); there the gpu-marked tests below cover the same paths natively, at realistic
# shapes, with far fewer compile-time variants. The tests without this mark run on both.
interp_only = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="CPU-interpreter matrix; the gpu-marked tests cover it natively")


def _inputs(shape_q, shape_k, shape_v, dtype, device, *, requires_grad=True):
    q = torch.randn(shape_q, dtype=dtype, device=device)
    k = torch.randn(shape_k, dtype=dtype, device=device)
    v = torch.randn(shape_v, dtype=dtype, device=device)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _grads(out, inputs, do):
    return torch.autograd.grad(out, inputs, do, allow_unused=True)


def _check_against_ref(q, k, v, *, mask=None, causal=False, scale=None, backend="triton", dropout_mask=None,
                       dropout_p=0.0, enable_gqa=False, out=None, do=None, what=""):
    """Run the kernel (unless ``out`` is given) and compare output + dq/dk/dv with the float64 and the
    same-dtype eager references."""
    if out is None:
        out = sdpa(q, k, v, mask, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=enable_gqa,
                   backend=backend)
    if do is None:
        do = torch.randn_like(out)
    g = _grads(out, (q, k, v), do)

    def ref(dt):
        qq, kk, vv = (t.detach().to(dt).requires_grad_(True) for t in (q, k, v))
        mm = mask.to(dt) if mask is not None and mask.dtype != torch.bool else mask
        o = attention_reference(qq, kk, vv, mm, dropout_p, causal, scale, enable_gqa, dropout_mask=dropout_mask)
        return o, _grads(o, (qq, kk, vv), do.to(dt))

    o_hi, g_hi = ref(torch.float64)
    o_lo, g_lo = ref(q.dtype)
    assert_close_to_ref(f"{what} out", out, o_hi, o_lo)
    for name, a, b, c in zip(("dq", "dk", "dv"), g, g_hi, g_lo):
        assert_close_to_ref(f"{what} {name}", a, b, c)
    return out, g


# ---------------------------------------------------------------------------------------------
# The eager lane (``pykernels.attention._lane``): same results as the full path, taken only where it covers
# ---------------------------------------------------------------------------------------------
def _lane_taken(out) -> bool:
    return type(out.grad_fn).__name__ == "_LaneFunctionBackward"


def _lane_vs_full(monkeypatch, q, k, v, **kw):
    """(out, grads) through the lane and through the full path (lane off): asserted bitwise equal."""
    import pykernels.attention as patt
    do = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    results = []
    for on in (True, False):
        monkeypatch.setattr(patt, "_LANE_ON", on)
        torch.manual_seed(1234)  # (the same dropout seeds in both passes)
        out = sdpa(q, k, v, **kw)
        assert _lane_taken(out) == on, f"lane {'not ' if on else ''}taken with _LANE_ON={on}"
        with torch.no_grad():
            plain = sdpa(q, k, v, **kw)  # (no autograd node: the lane's plain call)
        grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # (the caller may backpropagate again)
        results.append((out, grads, plain, do))
    (o1, g1, p1, _), (o2, g2, p2, _) = results
    for a, b in zip((o1, *g1, p1), (o2, *g2, p2)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    return results[0]


@pytest.mark.parametrize("layout,b,hq,hkv,sq,sk,d,causal,extra", [
    ("bhsd", 2, 2, 2, 17, 17, 16, False, None),
    ("bshd", 1, 4, 2, 20, 37, 32, True, None),        # transformers' transposed views, GQA, Sq < Sk
    ("bhsd", 1, 2, 1, 33, 9, 16, True, None),         # MQA, Sq > Sk
    ("bhsd", 3, 2, 2, 17, 19, 16, False, "keypad"),   # (B, 1, 1, Sk) bool, one batch without a valid key
    ("bshd", 1, 4, 2, 20, 37, 32, True, "additive"),  # (Sq, Sk) float, broadcast, with causal
    ("bhsd", 2, 2, 2, 17, 17, 16, False, "dropout")])
def test_eager_lane_equals_full_path(device, monkeypatch, layout, b, hq, hkv, sq, sk, d, causal, extra):
    """Calls with q, k, v of one (B, H, S, D) shape family take the eager lane (a cached check and backend
    choice, then the Triton backend's body): outputs and gradients bit for bit the full path's (with the same
    dropout seeds), and within the accuracy rule of the references; a second call of the same key (the cached
    entry) on fresh inputs too."""
    dtype = F32 if device.type == "cpu" else BF16

    def make(h, s):
        if layout == "bshd":
            return torch.randn(b, s, h, d, dtype=dtype, device=device).transpose(1, 2).requires_grad_(True)
        return torch.randn(b, h, s, d, dtype=dtype, device=device, requires_grad=True)
    for _ in range(2):
        q, k, v = make(hq, sq), make(hkv, sk), make(hkv, sk)
        mask, dropout_p = None, 0.0
        if extra == "keypad":
            keep = torch.arange(sk, device=device)[None, :] < torch.tensor([sk, 5, 0], device=device)[:, None]
            mask = keep[:, None, None, :]
        elif extra == "additive":
            mask = torch.randn(sq, sk, device=device) - torch.where(torch.rand(sq, sk, device=device) < 0.3, 1e4, 0.0)
        elif extra == "dropout":
            dropout_p = 0.3
        out, _, _, do = _lane_vs_full(monkeypatch, q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                      backend="triton")
        if extra != "dropout":  # (with dropout: bit for bit the full path, whose dropout tests are below)
            _check_against_ref(q, k, v, mask=mask, causal=causal, out=out, do=do, what="lane")


def test_eager_lane_backward_paths(device, monkeypatch):
    """The lane's backward: create_graph=True goes through the registered backward op (a second backward
    raises, never a silently missing gradient), and so does a call whose default backend changed to the
    reference between forward and backward (as the full path's backward would select it); both give the
    direct path's gradients."""
    import pykernels.attention as patt
    monkeypatch.setattr(patt, "_LANE_ON", True)
    q, k, v = _inputs((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16), F32, device)
    do = torch.randn(1, 2, 8, 16, device=device)
    out = sdpa(q, k, v, backend="triton")
    assert _lane_taken(out)
    direct = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    graphed = torch.autograd.grad(out, (q, k, v), do, retain_graph=True, create_graph=True)
    for a, b in zip(direct, graphed):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        graphed[0].sum().backward()
    out = sdpa(q, k, v)  # the default backend: auto (the reference on CPU tensors)
    if device.type == "cuda":
        assert _lane_taken(out)
        with pykernels.use_backend("reference"):
            ref = torch.autograd.grad(out, (q, k, v), do)
        for a, b in zip(ref, direct):  # the reference's gradients, within the rule of the fp32 test above
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_eager_lane_declines(device, monkeypatch):
    """Calls the lane does not cover run the full path: a mask that needs its gradient, fewer dims, broadcast
    batch or query heads, parameters, deterministic=True, the reference backend (also through ``use_backend``);
    float64, integer masks, mixed dtypes or devices and mismatched head dims get the full path's errors (the
    last twice: a declined key is remembered as declined)."""
    import pykernels.attention as patt
    monkeypatch.setattr(patt, "_LANE_ON", True)
    q, k, v = _inputs((1, 2, 9, 16), (1, 2, 11, 16), (1, 2, 11, 16), F32, device)
    assert _lane_taken(sdpa(q, k, v, backend="triton"))
    bias = torch.zeros(9, 11, device=device, requires_grad=True)
    declined = [
        lambda: sdpa(q, k, v, bias.detach() > 0, backend="triton"),  # covered: masks and dropout
        lambda: sdpa(q, k, v, dropout_p=0.5, backend="triton", scale=0.3),
        lambda: sdpa(q[0], k[0], v[0], backend="triton"),
        lambda: sdpa(q, k[:, :1].expand(1, 2, 11, 16), v, backend="triton", scale=0.25),  # a stride-0 head: covered
        lambda: sdpa(q.expand(2, 2, 9, 16), k, v, backend="triton"),
        lambda: sdpa(q[:, :1], k, v, backend="triton"),
        lambda: sdpa(q, k, v, backend="triton", deterministic=True),
        lambda: sdpa(q, k, v, backend="reference"),
        lambda: sdpa(torch.nn.Parameter(q.detach()), k, v, backend="triton"),
    ]
    taken = [_lane_taken(f()) for f in declined]
    assert taken == [True, True, False, True, False, False, False, False, False], taken
    with pytest.raises(BackendUnavailableError, match="requires grad"):  # a trainable bias: the full path's answer
        sdpa(q, k, v, bias, backend="triton")
    full_calls = []
    op = patt._attention_fwd
    monkeypatch.setattr(patt, "_attention_fwd", lambda *a: full_calls.append(1) or op(*a))
    with torch.no_grad():  # no gradient recorded: the bias is an ordinary mask, which the lane serves
        sdpa(q, k, v, bias, backend="triton")
        assert not full_calls
        sdpa(q[0], k[0], v[0], backend="triton")  # (and the spy sees the full path)
        assert full_calls
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor"):
        sdpa(q, k, v, [[True] * 11] * 9, backend="triton")
    with pytest.raises(TypeError, match="attn_mask must be bool"):  # the full path's error
        sdpa(q, k, v, torch.ones(9, 11, dtype=torch.int32, device=device), backend="triton")
    with pytest.raises(BackendUnavailableError, match="float64"):  # the full path's answer, not the lane's
        sdpa(*(t.detach().double() for t in (q, k, v)), backend="triton")
    with pykernels.use_backend("reference"):
        assert not _lane_taken(sdpa(q, k, v))
    with pytest.raises(ValueError, match="dtype"):
        sdpa(q, k.half(), v, backend="triton")
    if device.type == "cuda":
        with pytest.raises(ValueError, match="device"):
            sdpa(q, k.cpu(), v, backend="triton")
    if device.type == "cpu":  # auto runs the reference on CPU tensors: never the lane
        assert not _lane_taken(sdpa(q, k, v))
    with pytest.raises(ValueError, match="head dim"):  # the same key twice: still the full path's error
        sdpa(q, k[..., :8], v, backend="triton")
    with pytest.raises(ValueError, match="head dim"):
        sdpa(q, k[..., :8], v, backend="triton")


# ---------------------------------------------------------------------------------------------
# Dense forward + backward
# ---------------------------------------------------------------------------------------------
DENSE_CASES = [
    # B, Hq, Hkv, Sq, Sk, D, causal
    (1, 2, 2, 17, 17, 16, False),
    (2, 2, 2, 17, 17, 32, True),
    (1, 2, 2, 1, 17, 16, False),     # Sq = 1 (decode-like)
    (1, 2, 2, 1, 17, 16, True),      # Sq = 1 causal: top-left sees key 0 only
    (1, 1, 1, 127, 127, 16, True),   # longer odd length, causal split over many blocks
    (1, 4, 2, 20, 37, 24, True),     # GQA, Sq < Sk, D not a power of two
    (1, 4, 1, 37, 20, 16, True),     # MQA, Sq > Sk (bottom rows see all keys)
    (2, 2, 2, 19, 23, 80, False),    # D = 80 (padded to 128)
    (1, 2, 2, 18, 18, 96, True),     # D = 96
]


@interp_only
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", DENSE_CASES)
def test_dense_forward_backward(device, dtype, b, hq, hkv, sq, sk, d, causal):
    q, k, v = _inputs((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), dtype, device)
    _check_against_ref(q, k, v, causal=causal, enable_gqa=hq != hkv)


@interp_only
def test_value_head_dim_differs(device):
    q, k, v = _inputs((2, 2, 13, 16), (2, 2, 21, 16), (2, 2, 21, 40), F32, device)
    out, _ = _check_against_ref(q, k, v, causal=True)
    assert out.shape == (2, 2, 13, 40)


@interp_only
def test_custom_scale(device):
    q, k, v = _inputs((1, 2, 17, 32), (1, 2, 17, 32), (1, 2, 17, 32), F32, device)
    _check_against_ref(q, k, v, scale=0.37)


@pytest.mark.parametrize("sq,sk", [(3, 5), (5, 3), (4, 4), (1, 6)])
def test_causal_alignment_matches_torch(device, sq, sk):
    """torch's is_causal is top-left (tril, diagonal 0); ours must agree exactly in semantics."""
    q, k, v = _inputs((1, 2, sq, 16), (1, 2, sk, 16), (1, 2, sk, 16), torch.float64, "cpu", requires_grad=False)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = attention_reference(q, k, v, is_causal=True)
    torch.testing.assert_close(ref, expected)
    ours = sdpa(q.float().to(device), k.float().to(device), v.float().to(device), is_causal=True,
                backend="triton")
    torch.testing.assert_close(ours.double().cpu(), expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------
@interp_only
@pytest.mark.parametrize("dtype", [F32, F16])
def test_key_padding_mask(device, dtype):
    b, h, s, d = 3, 2, 37, 16
    lengths = torch.tensor([37, 20, 5])
    mask = (torch.arange(s)[None, :] < lengths[:, None]).view(b, 1, 1, s).to(device)
    q, k, v = _inputs((b, h, s, d), (b, h, s, d), (b, h, s, d), dtype, device)
    _check_against_ref(q, k, v, mask=mask)


@interp_only
def test_key_padding_left_padded_and_causal(device):
    """Valid keys in the middle of the row: the per-batch range starts past block 0."""
    b, h, s, d = 2, 2, 45, 16
    mask = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    mask[0, ..., 20:41] = True
    mask[1, ..., 3:9] = True
    q, k, v = _inputs((b, h, s, d), (b, h, s, d), (b, h, s, d), F32, device)
    # Row i < first valid key has no key under causal+mask: fully masked -> 0 (checked by the reference).
    _check_against_ref(q, k, v, mask=mask.to(device), causal=True)


@pytest.mark.parametrize("sk", [1, 37, 2500])
def test_key_padding_range_kernel_matches_eager(device, sk):
    """The key range the kernels skip by (lo, hi, dense) from the one-launch Triton kernel, against the eager
    ops the CPU path runs: prefix, suffix, holes, a single key, no valid key; bool and additive float rows,
    strided (a (B, 1, 1, Sk) view of a wider mask)."""
    from pykernels._kernels.attention import key_padding_range
    from pykernels.attention import _key_padding_range
    g = torch.Generator().manual_seed(sk)
    keep = torch.rand(6, sk + 3, generator=g) > 0.4
    keep[0] = True
    keep[1] = False
    keep[2, : sk // 2] = True
    keep[2, sk // 2:] = False
    keep[3] = False
    keep[3, sk - 1] = True
    keep[4, :] = False
    keep[4, sk // 3: sk // 3 + max(1, sk // 4)] = True
    wide = keep[:, 1:sk + 1]  # a strided row view
    for row in (wide, torch.zeros(wide.shape).masked_fill(~wide, float("-inf"))):
        mask = row.to(device)[:, None, None, :]
        expected = _key_padding_range(mask.cpu())
        got = key_padding_range(mask[:, 0, 0, :])
        assert got.dtype == torch.int32 and got.shape == (6, 3)
        assert torch.equal(got.cpu(), expected), (got, expected)
        valid = wide.cpu()
        for b in range(6):
            idx = valid[b].nonzero().flatten()
            lo, hi = (int(idx[0]), int(idx[-1]) + 1) if len(idx) else (sk, 0)
            assert expected[b, :2].tolist() == [lo, hi]
            if len(idx):
                assert bool(expected[b, 2]) == bool(valid[b, lo:hi].all())


@interp_only
def test_additive_float_key_padding(device):
    b, h, s, d = 2, 2, 33, 16
    mask = torch.zeros(b, 1, 1, s)
    mask[0, ..., 25:] = float("-inf")
    mask[1, ..., :7] = float("-inf")
    q, k, v = _inputs((b, h, s, d), (b, h, s, d), (b, h, s, d), F32, device)
    _check_against_ref(q, k, v, mask=mask.to(device))


@interp_only
@pytest.mark.parametrize("dtype", [F32, F16])
def test_arbitrary_bool_mask(device, dtype):
    q, k, v = _inputs((2, 2, 19, 16), (2, 2, 26, 16), (2, 2, 26, 16), dtype, device)
    mask = (torch.rand(2, 2, 19, 26) > 0.4).to(device)
    _check_against_ref(q, k, v, mask=mask)


@interp_only
@pytest.mark.parametrize("dtype,mask_dtype", [(F32, F32), (F16, F16), (F16, F32)])
def test_additive_mask_broadcast(device, dtype, mask_dtype):
    """A (Sq, Sk) float mask broadcast over batch and heads (strides 0 in-kernel, never expanded);
    the mask may be fp32 with fp16 inputs."""
    q, k, v = _inputs((2, 3, 19, 16), (2, 3, 26, 16), (2, 3, 26, 16), dtype, device)
    mask = torch.randn(19, 26, dtype=mask_dtype).to(device)
    _check_against_ref(q, k, v, mask=mask)


@interp_only
def test_mask_per_head_broadcast_batch(device):
    q, k, v = _inputs((2, 3, 17, 16), (2, 3, 17, 16), (2, 3, 17, 16), F32, device)
    mask = (torch.rand(1, 3, 17, 17) > 0.3).to(device)
    _check_against_ref(q, k, v, mask=mask, causal=True)


@interp_only
def test_per_head_key_mask_row_broadcast(device):
    """(B, H, 1, Sk): read as one vector per key block but not a key-padding range (varies by head)."""
    q, k, v = _inputs((2, 3, 21, 16), (2, 3, 29, 16), (2, 3, 29, 16), F32, device)
    mask = (torch.rand(2, 3, 1, 29) > 0.5).to(device)
    _check_against_ref(q, k, v, mask=mask, causal=True)


@interp_only
def test_int64_in_slice_offsets_path(device, monkeypatch):
    """The IDX64 variant (used when one (batch, head) slice spans >= 2**31 elements) on tiny shapes."""
    import pykernels._kernels.attention as kern
    monkeypatch.setattr(kern, "_needs_idx64", lambda *a: True)
    q, k, v = _inputs((1, 2, 19, 16), (1, 2, 23, 16), (1, 2, 23, 16), F32, device)
    _check_against_ref(q, k, v, mask=(torch.rand(1, 2, 19, 23) > 0.3).to(device), causal=True)


def test_reference_backend_gradcheck():
    """fp64 gradcheck of the reference backend's hand-written backward (GQA, mask, causal)."""
    q = torch.randn(1, 4, 5, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 7, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 7, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(1, 1, 5, 7) > 0.3
    mask[..., 0] = True
    torch.autograd.gradcheck(lambda q, k, v: sdpa(q, k, v, mask, is_causal=True, backend="reference"), (q, k, v))


def test_fully_masked_rows_give_zero(device):
    """Rows with no allowed key: output 0, gradients 0, no NaN (torch's SDPA gives NaN there)."""
    b, h, sq, sk, d = 2, 2, 21, 18, 16
    mask = torch.rand(b, h, sq, sk) > 0.3
    mask[0, :, 3] = False
    mask[1, 1, 7:12] = False
    mask = mask.to(device)
    q, k, v = _inputs((b, h, sq, d), (b, h, sk, d), (b, h, sk, d), F32, device)
    out, (dq, dk, dv) = _check_against_ref(q, k, v, mask=mask)
    assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    assert torch.equal(out[1, 1, 7:12], torch.zeros_like(out[1, 1, 7:12]))
    assert torch.equal(dq[0, :, 3], torch.zeros_like(dq[0, :, 3]))
    # A whole batch with no valid key (key-padding fast path).
    kp = torch.ones(b, 1, 1, sk, dtype=torch.bool)
    kp[1] = False
    out, (dq, dk, dv) = _check_against_ref(q, k, v, mask=kp.to(device))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for g in (dq[1], dk[1], dv[1]):
        assert torch.equal(g, torch.zeros_like(g))


@interp_only
def test_empty_key_sequence(device):
    q, k, v = _inputs((1, 2, 5, 16), (1, 2, 0, 16), (1, 2, 0, 16), F32, device)
    out = sdpa(q, k, v, backend="triton")
    assert torch.equal(out, torch.zeros_like(out))
    dq, dk, dv = _grads(out, (q, k, v), torch.randn_like(out))
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.shape == k.shape


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------
def test_strided_and_expanded_inputs(device):
    b, h, s, d = 2, 2, 19, 16
    # (B, S, H, D) storage seen as (B, H, S, D): non-contiguous, last dim contiguous.
    q = torch.randn(b, s, h, d, device=device).transpose(1, 2).requires_grad_(False)
    q = q.detach().requires_grad_(True)
    # K/V broadcast over the batch with stride 0 (never materialised).
    k0 = torch.randn(1, h, s, d, device=device, requires_grad=True)
    v0 = torch.randn(1, h, s, d, device=device, requires_grad=True)
    k, v = k0.expand(b, h, s, d), v0.expand(b, h, s, d)
    assert not q.is_contiguous() and k.stride(0) == 0
    out = sdpa(q, k, v, is_causal=True, backend="triton")
    do = torch.randn_like(out)
    dq, dk0, dv0 = _grads(out, (q, k0, v0), do)
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k0, v0))
    ref = attention_reference(qd, kd.expand(b, h, s, d), vd.expand(b, h, s, d), is_causal=True)
    rq, rk, rv = _grads(ref, (qd, kd, vd), do.double())
    qf, kf, vf = (t.detach().requires_grad_(True) for t in (q, k0, v0))
    lo = attention_reference(qf, kf.expand(b, h, s, d), vf.expand(b, h, s, d), is_causal=True)
    lq, lk, lv = _grads(lo, (qf, kf, vf), do)
    assert_close_to_ref("out", out, ref, lo)
    assert_close_to_ref("dq", dq, rq, lq)
    assert_close_to_ref("dk", dk0, rk, lk)
    assert_close_to_ref("dv", dv0, rv, lv)


@interp_only
def test_last_dim_not_contiguous(device):
    base = torch.randn(1, 2, 17, 32, device=device)
    q = base[..., ::2].detach().requires_grad_(True)  # stride(-1) == 2
    k = torch.randn(1, 2, 17, 16, device=device, requires_grad=True)
    v = torch.randn(1, 2, 17, 16, device=device, requires_grad=True)
    assert q.stride(-1) == 2
    _check_against_ref(q, k, v)


@interp_only
@pytest.mark.parametrize("shape_q,shape_k", [((17, 16), (13, 16)), ((3, 17, 16), (3, 13, 16)),
                                             ((2, 2, 2, 9, 16), (2, 1, 2, 13, 16)), ((1, 9, 16), (4, 13, 16))])
def test_other_ranks_and_batch_broadcast(device, shape_q, shape_k):
    q, k, v = _inputs(shape_q, shape_k, shape_k, F32, device)
    out = sdpa(q, k, v, backend="triton")
    expected_shape = torch.nn.functional.scaled_dot_product_attention(
        q.detach().cpu(), k.detach().cpu(), v.detach().cpu()).shape
    assert out.shape == expected_shape
    _check_against_ref(q, k, v, out=out)


# ---------------------------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------------------------
_RANDINT4X = []


def _randint4x_kernel():
    """A kernel that writes tl.randint4x's four words for int64 counters (made at first use, after conftest has
    set the interpreter)."""
    if not _RANDINT4X:
        import triton
        import triton.language as tl

        @triton.jit
        def randint4x_kernel(O, seed, Offs, N: tl.constexpr, ROUNDS: tl.constexpr):
            offs = tl.load(Offs + tl.arange(0, N))
            r0, r1, r2, r3 = tl.randint4x(seed, offs, ROUNDS)
            i = tl.arange(0, N)
            tl.store(O + i, r0.to(tl.int64) & 0xFFFFFFFF)
            tl.store(O + N + i, r1.to(tl.int64) & 0xFFFFFFFF)
            tl.store(O + 2 * N + i, r2.to(tl.int64) & 0xFFFFFFFF)
            tl.store(O + 3 * N + i, r3.to(tl.int64) & 0xFFFFFFFF)

        _RANDINT4X.append(randint4x_kernel)
    return _RANDINT4X[0]


def test_philox_matches_triton(device):
    from pykernels._kernels.attention import dropout_mask_triton
    seed = 123456789
    got = dropout_mask_triton(seed, 2, 3, 7, 11, 0.3, device).cpu()
    want = attention_dropout_mask(seed, 2, 3, 7, 11, 0.3, "cpu")
    assert torch.equal(got, want)
    # philox4x32 is tl.randint4x bit for bit, for int64 counters past 2**32 (the high word feeds the second
    # Philox counter) and seeds past 2**32, at the dropout's rounds (the default) and at Triton's default ten; the
    # Triton helper every kernel draws through takes the same rounds.
    from pykernels._kernels._dropout import PHILOX_ROUNDS as triton_rounds
    assert PHILOX_ROUNDS == triton_rounds == 7
    offs = torch.tensor([0, 1, 2**32 - 1, 2**32, 2**32 + 5, 3 * 2**33 + 7, 2**62 + 11, 12345], dtype=torch.int64)
    for rounds in (PHILOX_ROUNDS, 10):
        for seed in (seed, 2**40 + 17):
            got = torch.full((4, len(offs)), -1, dtype=torch.int64, device=device)
            _randint4x_kernel()[(1,)](got, seed, offs.to(device), N=len(offs), ROUNDS=rounds)
            want = torch.stack(philox4x32(seed, offs, rounds))
            assert torch.equal(got.cpu(), want), (rounds, seed)
            assert len(set(want[0].tolist())) == len(offs)


@pytest.mark.parametrize("rounds,seed,words", [
    (7, 0, (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (10, 0, (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8))])
def test_philox_known_answers(rounds, seed, words):
    """philox4x32 against Random123's known-answer vectors (kat_vectors: philox4x32 at 7 and 10 rounds, counter and
    key zero), so that the eager copy, and through the tests above every kernel's mask, is Philox itself and not only
    self-consistent; and a seed's high word reaches the key (seed 2**32 is not seed 0)."""
    got = philox4x32(seed, torch.zeros(1, dtype=torch.int64), rounds)
    assert tuple(int(w) for w in got) == words
    assert tuple(int(w) for w in philox4x32(2**32, torch.zeros(1, dtype=torch.int64), rounds)) != words
    for bad in (0, -1, 7.0, True):
        with pytest.raises(ValueError, match="rounds"):
            philox4x32(seed, torch.zeros(1, dtype=torch.int64), bad)


def test_dropout_keep_rate():
    p = 0.3
    keep = attention_dropout_mask(7, 4, 4, 64, 64, p, "cpu")
    n = keep.numel()
    rate = keep.float().mean().item()
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 6 * sd, (rate, sd)


@interp_only
@pytest.mark.parametrize("causal,gqa", [(False, False), (True, True)])
def test_dropout_matches_reference_with_mask(device, causal, gqa):
    """Forward and backward regenerate the mask from the same seed: both must equal the reference
    given ``attention_dropout_mask`` of that seed."""
    b, hq, hkv, sq, sk, d, p = 2, 4, 2 if gqa else 4, 19, 23, 16, 0.25
    q, k, v = _inputs((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), F32, device)
    torch.manual_seed(1234)
    seed = new_seed(q.device)
    torch.manual_seed(1234)
    out = sdpa(q, k, v, dropout_p=p, is_causal=causal, backend="triton")
    dmask = attention_dropout_mask(seed, b, hq, sq, sk, p, device)
    _check_against_ref(q, k, v, causal=causal, dropout_p=p, dropout_mask=dmask, out=out)
    # The reference backend uses the same stream.
    torch.manual_seed(1234)
    out_ref_backend = sdpa(q, k, v, dropout_p=p, is_causal=causal, backend="reference")
    torch.testing.assert_close(out_ref_backend, out, atol=1e-5, rtol=1e-5)


def _spy_dq_split(monkeypatch) -> list:
    """The ``D_A`` of every launch of the Triton dQ kernel (``kernels.attention._attention_bwd_dq_kernel``)."""
    from pykernels._kernels import _launch
    from pykernels._kernels import attention as katt
    seen, real = [], _launch.fast

    def fast(kernel):
        fk = real(kernel)
        if kernel is not katt._attention_bwd_dq_kernel:
            return fk

        class Spy:
            def __getitem__(self, grid):
                def launch(*a, **kw):
                    seen.append(kw.get("D_A"))
                    return fk[grid](*a, **kw)
                return launch
        return Spy()
    monkeypatch.setattr(_launch, "fast", fast)
    return seen


@pytest.mark.parametrize("case", ["causal_gqa", "keys_dropout", "varlen"])
def test_triton_dq_split_head_dim(device, monkeypatch, case):
    """The Triton dQ kernel at D = Dv = 192 on the column blocks 128 + 64 (``kernels.attention.DQ_SPLIT``, the
    default): the three gradients against float64 and eager's error (causal GQA with Sq != Sk and odd lengths; key
    padding with dropout, whose mask the kernel regenerates; varlen against its sequences one by one), and equal,
    within rounding, to the kernel padded to 256 columns. The split's launches are checked (``D_A``)."""
    from pykernels._kernels import attention as katt
    dtype = F32 if device == "cpu" else F16
    seen = _spy_dq_split(monkeypatch)
    monkeypatch.setattr(katt, "DQ_SPLIT", True)
    if case == "varlen":
        lens, h, d = [17, 0, 5], 2, 192
        cu = torch.tensor([0, 17, 17, 22], dtype=torch.int32, device=device)
        q, k, v = (torch.randn(22, h, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
        out = varlen_attention(q, k, v, cu, cu, 17, 17, causal=True, backend="triton")
        do = torch.randn_like(out)
        grads = _grads(out, (q, k, v), do)
        for lo, n in ((0, 17), (22 - 5, 5)):  # each sequence against its own (B = 1) references, float64 and eager's
            refs = []
            for dt in (torch.float64, dtype):
                qs, ks, vs = (t.detach()[lo:lo + n].transpose(0, 1)[None].to(dt).requires_grad_(True) for t in (q, k, v))
                ref = attention_reference(qs, ks, vs, None, is_causal=True)
                refs.append(_grads(ref, (qs, ks, vs), do[lo:lo + n].transpose(0, 1)[None].to(dt)))
            for name, g, hi, lo_ in zip(("dq", "dk", "dv"), grads, *refs):
                assert_close_to_ref(f"dq split varlen {name}", g[lo:lo + n].transpose(0, 1)[None], hi, lo_)
    else:
        b, hq, hkv, sq, sk = (2, 4, 2, 17, 23) if case == "causal_gqa" else (2, 2, 2, 19, 19)
        q, k, v = _inputs((b, hq, sq, 192), (b, hkv, sk, 192), (b, hkv, sk, 192), dtype, device)
        do = torch.randn(b, hq, sq, 192, dtype=dtype, device=device)
        if case == "causal_gqa":
            out, grads = _check_against_ref(q, k, v, causal=True, enable_gqa=True, do=do, what="dq split causal gqa")
        else:
            keys = (torch.arange(sk, device=device) < torch.tensor([[sk], [7]], device=device)).view(b, 1, 1, sk)
            torch.manual_seed(77)
            seed = new_seed(q.device)
            torch.manual_seed(77)
            out = sdpa(q, k, v, attn_mask=keys, dropout_p=0.25, backend="triton")
            dmask = attention_dropout_mask(seed, b, hq, sq, sk, 0.25, device)
            _, grads = _check_against_ref(q, k, v, mask=keys, dropout_p=0.25, dropout_mask=dmask, out=out, do=do,
                                          what="dq split keys dropout")
    assert seen and all(a == 128 for a in seen), seen
    monkeypatch.setattr(katt, "DQ_SPLIT", False)
    seen.clear()
    if case == "varlen":
        padded = _grads(varlen_attention(q, k, v, cu, cu, 17, 17, causal=True, backend="triton"), (q, k, v), do)
    elif case == "causal_gqa":
        padded = _grads(sdpa(q, k, v, is_causal=True, enable_gqa=True, backend="triton"), (q, k, v), do)
    else:
        torch.manual_seed(77)
        padded = _grads(sdpa(q, k, v, attn_mask=keys, dropout_p=0.25, backend="triton"), (q, k, v), do)
    assert seen and all(a == 0 for a in seen), seen
    for name, x, y in zip("qkv", grads, padded):
        assert (x.double() - y.double()).abs().max().item() <= 1e-3 * max(1.0, y.double().abs().max().item()), name


@interp_only
def test_dropout_seeded_reproducibility(device):
    q, k, v = _inputs((1, 2, 17, 16), (1, 2, 17, 16), (1, 2, 17, 16), F32, device, requires_grad=False)
    torch.manual_seed(5)
    a = sdpa(q, k, v, dropout_p=0.5, backend="triton")
    torch.manual_seed(5)
    b = sdpa(q, k, v, dropout_p=0.5, backend="triton")
    c = sdpa(q, k, v, dropout_p=0.5, backend="triton")
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# ---------------------------------------------------------------------------------------------
# Determinism, compile, backends
# ---------------------------------------------------------------------------------------------
@interp_only
def test_deterministic_backward_bitwise(device):
    q, k, v = _inputs((2, 4, 33, 16), (2, 2, 33, 16), (2, 2, 33, 16), F32, device)
    do = torch.randn(2, 4, 33, 16, device=device)
    runs = []
    for _ in range(2):
        out = sdpa(q, k, v, is_causal=True, backend="triton", deterministic=True)
        runs.append(_grads(out, (q, k, v), do))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@interp_only
def test_deterministic_reaches_the_backward(monkeypatch, device):
    # the backward's kernels learn whether it must be reproducible (the fused sm_90 kernel is not): True as
    # asked, or from torch's deterministic mode when None, saved with the forward, eager and compiled
    from pykernels._kernels import attention as katt
    seen = []

    def spy(*a, _f=katt.attention_bwd, **kw):
        seen.append(kw["deterministic"])
        return _f(*a, **kw)
    monkeypatch.setattr(katt, "attention_bwd", spy)
    q, k, v = _inputs((1, 2, 17, 16), (1, 2, 17, 16), (1, 2, 17, 16), F32, device)
    do = torch.randn(1, 2, 17, 16, device=device)
    for flag in (True, False, None):
        _grads(sdpa(q, k, v, backend="triton", deterministic=flag), (q, k, v), do)
    det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _grads(sdpa(q, k, v, backend="triton"), (q, k, v), do)
    finally:
        torch.use_deterministic_algorithms(det)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: sdpa(q, k, v, backend="triton", deterministic=True), fullgraph=True)
    _grads(compiled(q, k, v), (q, k, v), do)
    assert seen == [True, False, det, True, True]


def test_torch_compile_fullgraph(device):
    q, k, v = _inputs((1, 2, 17, 16), (1, 2, 17, 16), (1, 2, 17, 16), F32, device)
    mask = (torch.rand(1, 1, 1, 17) > 0.2).to(device)

    def f(q, k, v):
        return sdpa(q, k, v, mask, is_causal=True, backend="triton") * 2.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out_c = compiled(q, k, v)
    out_e = f(q, k, v)
    torch.testing.assert_close(out_c, out_e)
    do = torch.randn_like(out_e)
    for a, b in zip(_grads(out_c, (q, k, v), do), _grads(out_e, (q, k, v), do)):
        torch.testing.assert_close(a, b)


@interp_only
def test_reference_backend_and_use_backend(device):
    q, k, v = _inputs((1, 2, 9, 16), (1, 2, 11, 16), (1, 2, 11, 16), F32, device)
    with pykernels.use_backend("reference"):
        out, _ = _check_against_ref(q, k, v, causal=True, backend=None)
    torch.testing.assert_close(out, sdpa(q, k, v, is_causal=True, backend="triton"), atol=1e-5, rtol=1e-5)


def test_trainable_float_mask_gets_its_gradient(device):
    """A float mask that requires grad runs the eager reference (the kernels give no mask gradient)."""
    q, k, v = _inputs((1, 2, 7, 16), (1, 2, 9, 16), (1, 2, 9, 16), F32, device)
    bias = torch.randn(2, 7, 9, device=device, requires_grad=True)
    with pytest.raises(BackendUnavailableError, match="attn_mask requires grad"):
        sdpa(q, k, v, bias, backend="triton")
    out = sdpa(q, k, v, bias, backend="auto")
    (g,) = torch.autograd.grad(out.sum(), bias)
    qd, kd, vd, bd = (t.detach().double() for t in (q, k, v, bias))
    bd.requires_grad_(True)
    (g_ref,) = torch.autograd.grad(attention_reference(qd, kd, vd, bd).sum(), bd)
    torch.testing.assert_close(g.double(), g_ref, atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # no gradient needed: the kernels serve it
        torch.testing.assert_close(sdpa(q, k, v, bias, backend="triton"), out.detach(), atol=1e-5, rtol=1e-5)


def test_explicit_backend_raises(device):
    q, k, v = _inputs((1, 1, 4, 16), (1, 1, 4, 16), (1, 1, 4, 16), F32, device, requires_grad=False)
    with pytest.raises(BackendUnavailableError, match="cuda"):
        sdpa(q, k, v, backend="cuda")
    q, k, v = _inputs((1, 1, 4, 320), (1, 1, 4, 320), (1, 1, 4, 320), F32, device, requires_grad=False)
    with pytest.raises(BackendUnavailableError, match="head dim 320"):
        sdpa(q, k, v, backend="triton")
    # auto on CPU tensors runs the reference, silently and correctly.
    qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
    torch.testing.assert_close(sdpa(qc, kc, vc, backend="auto"), attention_reference(qc, kc, vc))


# ---------------------------------------------------------------------------------------------
# Varlen and pad/unpad
# ---------------------------------------------------------------------------------------------
def _varlen_case(lengths_q, lengths_k, hq, hkv, d, dtype, device, extra_rows=0):
    cu_q = torch.tensor([0] + torch.tensor(lengths_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lengths_k).cumsum(0).tolist(), dtype=torch.int32)
    tq, tk = int(cu_q[-1]) + extra_rows, int(cu_k[-1]) + extra_rows
    q, k, v = _inputs((tq, hq, d), (tk, hkv, d), (tk, hkv, d), dtype, device)
    return q, k, v, cu_q.to(device), cu_k.to(device)


@interp_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_varlen_equals_per_sequence(device, causal, dtype):
    lq, lk = [5, 0, 17, 9], [7, 4, 17, 0]
    q, k, v, cu_q, cu_k = _varlen_case(lq, lk, 4, 2, 16, dtype, device, extra_rows=3)
    out = varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, backend="triton")
    do = torch.randn_like(out)
    _check_varlen_per_sequence(out, _grads(out, (q, k, v), do), q, k, v, do, cu_q, cu_k, causal, dtype, zero_tail=True)


def _check_varlen_per_sequence(out, grads, q, k, v, do, cu_q, cu_k, causal, dtype, zero_tail=False):
    """Each sequence's output and gradients of a varlen call against the reference on that sequence alone
    (float64 and ``dtype``, by the accuracy rule); zero-length query sequences are skipped. ``zero_tail``: also the
    rows past cu_seqlens[-1], whose output and gradients are defined zeros."""
    dq, dk, dv = grads
    for t, end in ((out, cu_q[-1]), (dq, cu_q[-1]), (dk, cu_k[-1]), (dv, cu_k[-1])) if zero_tail else ():
        assert torch.equal(t[int(end):], torch.zeros_like(t[int(end):]))
    for i in range(cu_q.numel() - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if qe == qs:
            continue

        def seq(dt):
            qq, kk, vv = (t.detach().to(dt).requires_grad_(True) for t in (q, k, v))
            o = attention_reference(qq[qs:qe].transpose(0, 1), kk[ks:ke].transpose(0, 1),
                                    vv[ks:ke].transpose(0, 1), is_causal=causal).transpose(0, 1)
            return o, _grads(o, (qq, kk, vv), do[qs:qe].to(dt))

        o_hi, g_hi = seq(torch.float64)
        o_lo, g_lo = seq(dtype)
        assert_close_to_ref(f"seq{i} out", out[qs:qe], o_hi, o_lo)
        assert_close_to_ref(f"seq{i} dq", dq[qs:qe], g_hi[0][qs:qe], g_lo[0][qs:qe])
        assert_close_to_ref(f"seq{i} dk", dk[ks:ke], g_hi[1][ks:ke], g_lo[1][ks:ke])
        assert_close_to_ref(f"seq{i} dv", dv[ks:ke], g_hi[2][ks:ke], g_lo[2][ks:ke])


@pytest.mark.parametrize("causal,dropout_p", [(False, 0.0), (True, 0.0), (False, 0.3)])
def test_varlen_eager_lane_equals_full_path(device, monkeypatch, causal, dropout_p):
    """Varlen calls take the eager lane, keyed without the token counts and max lengths (two batches of other
    lengths share one entry): output and gradients bit for bit the full path's (the same dropout seeds), and,
    without dropout, each sequence within the accuracy rule."""
    import pykernels.attention as patt
    dtype = F32 if device.type == "cpu" else BF16
    for lq, lk in (([5, 0, 17, 9], [7, 4, 17, 0]), ([3, 11, 1, 20], [6, 2, 9, 13])):
        q, k, v, cu_q, cu_k = _varlen_case(lq, lk, 4, 2, 16, dtype, device)
        do = torch.randn(q.shape[0], 4, 16, dtype=dtype, device=device)
        results = []
        for on in (True, False):
            monkeypatch.setattr(patt, "_LANE_ON", on)
            torch.manual_seed(99)
            out = varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, dropout_p=dropout_p,
                                   backend="triton")
            assert (type(out.grad_fn).__name__ == "_VarlenLaneFunctionBackward") == on
            results.append((out, torch.autograd.grad(out, (q, k, v), do, retain_graph=True)))
        for a, b in zip((results[0][0], *results[0][1]), (results[1][0], *results[1][1])):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        if dropout_p == 0:
            _check_varlen_per_sequence(results[0][0], results[0][1], q, k, v, do, cu_q, cu_k, causal, dtype)
    # not covered: int64 cu_seqlens and 4-D q get the full path's errors; k and v of other token counts too
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        varlen_attention(q, k, v, cu_q.long(), cu_k, max(lq), max(lk), backend="triton")
    with pytest.raises(ValueError, match="same tokens"):
        varlen_attention(q, k, v[:-1], cu_q, cu_k, max(lq), max(lk), backend="triton")
    with pytest.raises(ValueError, match="max_seqlen_q"):
        varlen_attention(q, k, v, cu_q, cu_k, -1, max(lk), backend="triton")


def test_varlen_equals_padded_via_unpad(device):
    b, s, h, d = 3, 21, 2, 16
    lengths = torch.tensor([21, 9, 14])
    attn = torch.arange(s)[None, :] < lengths[:, None]
    x = torch.randn(b, s, 3, h, d, device=device)  # packed q, k, v per token
    x_unpad, indices, cu, max_s = unpad_input(x, attn.to(device))
    assert max_s == 21 and cu.dtype == torch.int32 and cu.tolist() == [0, 21, 30, 44]
    q, k, v = (x_unpad[:, i].detach().requires_grad_(True) for i in range(3))
    out = varlen_attention(q, k, v, cu, cu, max_s, max_s, backend="triton")
    padded = pad_input(out, indices, b, s)  # (B, S, H, D)
    qp, kp, vp = (x[:, :, i].transpose(1, 2) for i in range(3))
    ref = sdpa(qp, kp, vp, attn.view(b, 1, 1, s).to(device), backend="triton").transpose(1, 2)
    valid = attn.to(device)
    torch.testing.assert_close(padded[valid], ref[valid], atol=1e-5, rtol=1e-5)
    assert torch.equal(padded[~valid], torch.zeros_like(padded[~valid]))


def test_unpad_pad_roundtrip_and_grad():
    x = torch.randn(2, 5, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]])
    xu, idx, cu, m = unpad_input(x, mask)
    assert xu.shape == (3, 3) and idx.dtype == torch.int64 and cu.tolist() == [0, 3, 3] and m == 3
    y = pad_input(xu * 2, idx, 2, 5)
    expected = x.detach() * 2 * mask[..., None]
    assert torch.equal(y, expected)
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, 2.0 * mask[..., None].float().expand_as(g))


@interp_only
def test_varlen_all_empty(device):
    q, k, v, cu_q, cu_k = _varlen_case([0, 0], [0, 3], 2, 2, 16, F32, device, extra_rows=2)
    out = varlen_attention(q, k, v, cu_q, cu_k, 0, 3, backend="triton")
    assert torch.equal(out, torch.zeros_like(out))
    dq, dk, dv = _grads(out, (q, k, v), torch.randn_like(out))
    for g in (dq, dk, dv):
        assert torch.equal(g, torch.zeros_like(g))


@interp_only
def test_varlen_dropout_matches_reference_backend(device):
    q, k, v, cu_q, cu_k = _varlen_case([5, 11], [6, 11], 2, 1, 16, F32, device)
    outs = []
    for backend in ("triton", "reference"):
        torch.manual_seed(3)
        o = varlen_attention(q, k, v, cu_q, cu_k, 11, 11, dropout_p=0.3, causal=True, backend=backend)
        outs.append((o, _grads(o, (q, k, v), torch.ones_like(o))))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Input errors
# ---------------------------------------------------------------------------------------------
def _qkv(*shape, dtype=F32):
    return torch.randn(*shape, dtype=dtype)


def test_bad_inputs():
    q = _qkv(1, 2, 4, 16)
    with pytest.raises(ValueError, match=r"query must have at least 2 dims, got shape \(4,\)"):
        sdpa(torch.randn(4), q, q)
    with pytest.raises(TypeError, match="query must have dtype"):
        sdpa(torch.ones(1, 2, 4, 16, dtype=torch.int32), q, q)
    with pytest.raises(ValueError, match="key has dtype"):
        sdpa(q, q.half(), q)
    with pytest.raises(ValueError, match="same head dim"):
        sdpa(q, _qkv(1, 2, 4, 32), _qkv(1, 2, 4, 32))
    with pytest.raises(ValueError, match="same sequence length"):
        sdpa(q, q, _qkv(1, 2, 5, 16))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        sdpa(_qkv(1, 3, 4, 16), q, q, enable_gqa=True)
    with pytest.raises(ValueError, match="attn_mask of shape"):
        sdpa(q, q, q, torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        sdpa(q, q, q, torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="dropout_p must be in"):
        sdpa(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        sdpa(q, q, q, dropout_p=-0.1)
    with pytest.raises(ValueError, match="backend must be one of"):
        sdpa(q, q, q, backend="fast")
    with pytest.raises(TypeError, match="scale must be"):
        sdpa(q, q, q, scale="big")
    with pytest.raises(ValueError, match="key and value must have the same number of heads"):
        sdpa(_qkv(1, 4, 4, 16), _qkv(1, 2, 4, 16), _qkv(1, 1, 4, 16))
    with pytest.raises(ValueError, match="do not broadcast"):
        sdpa(_qkv(2, 2, 4, 16), _qkv(3, 2, 4, 16), _qkv(3, 2, 4, 16))


def test_bad_varlen_inputs():
    q = _qkv(6, 2, 16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must have 3 dims"):
        varlen_attention(_qkv(1, 6, 2, 16), q, q, cu, cu, 6, 6)
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype"):
        varlen_attention(q, q, q, cu.long(), cu, 6, 6)
    with pytest.raises(ValueError, match="max_seqlen_k must be a non-negative int"):
        varlen_attention(q, q, q, cu, cu, 6, -1)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        varlen_attention(_qkv(6, 3, 16), q, q, cu, cu, 6, 6)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        unpad_input(torch.randn(2, 5, 3), torch.ones(2, 4))


# ---------------------------------------------------------------------------------------------
# GPU (bf16, realistic shapes); run by the lead on the GPU machine
# ---------------------------------------------------------------------------------------------
# Each distinct set of compile-time flags (dtype, padded head dim, causal, mask kind, dropout, varlen,
# and Triton's specialisation of ints equal to 1) compiles three kernels, so the cases below are
# chosen to cover the paths with few distinct variants.
@pytest.mark.gpu
@pytest.mark.parametrize("d,causal", [(64, False), (128, True), (80, True), (256, False), (32, True)])
def test_gpu_bf16_head_dims(d, causal):
    q, k, v = _inputs((2, 4, 1000, d), (2, 4, 1000, d), (2, 4, 1000, d), BF16, "cuda")
    _check_against_ref(q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [256, 192, 136])
def test_gpu_triton_d256_tier_masks_dropout_gqa(d):
    """The D = 256 tier's tiles (128 < D <= 256: the first entry each kernel's pruner keeps on this card, masks and
    dropout taking the entries whose shared memory fits with them): GQA causal with odd lengths, an additive and a
    boolean mask, key padding with a fully masked batch (output and gradients 0), dropout against the seed's mask,
    packed varlen sequences (empty, one-row, Sq != Sk; rows past the last sequence zero)."""
    b, hq, hkv = 2, 4, 2
    q, k, v = _inputs((b, hq, 333, d), (b, hkv, 333, d), (b, hkv, 333, d), BF16, "cuda")
    _check_against_ref(q, k, v, causal=True, enable_gqa=True, what=f"d{d} causal gqa")
    _check_against_ref(q, k, v, mask=torch.randn(1, hq, 333, 333, device="cuda", dtype=BF16), enable_gqa=True,
                       what=f"d{d} additive")
    _check_against_ref(q, k, v, mask=torch.rand(b, 1, 333, 333, device="cuda") > 0.5, causal=True, enable_gqa=True,
                       what=f"d{d} bool")
    keys = (torch.arange(333, device="cuda") < torch.tensor([[200], [0]], device="cuda")).view(b, 1, 1, 333)
    out, g = _check_against_ref(q, k, v, mask=keys, enable_gqa=True, what=f"d{d} key padding")
    assert out[1].abs().max() == 0 and all(t[1].abs().max() == 0 for t in g)
    torch.manual_seed(5)
    seed = new_seed(q.device)
    torch.manual_seed(5)
    out = sdpa(q, k, v, dropout_p=0.2, is_causal=True, enable_gqa=True, backend="triton")
    dmask = attention_dropout_mask(seed, b, hq, 333, 333, 0.2, "cuda")
    _check_against_ref(q, k, v, causal=True, dropout_p=0.2, dropout_mask=dmask, enable_gqa=True, out=out,
                       what=f"d{d} dropout")
    lq, lk = [300, 1, 0, 77], [260, 5, 9, 130]  # packed varlen: empty and one-row sequences, Sq != Sk
    q, k, v, cu_q, cu_k = _varlen_case(lq, lk, hq, hkv, d, BF16, "cuda", extra_rows=3)
    out = varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, backend="triton")
    do = torch.randn_like(out)
    _check_varlen_per_sequence(out, _grads(out, (q, k, v), do), q, k, v, do, cu_q, cu_k, True, BF16, zero_tail=True)


@pytest.mark.gpu
def test_gpu_triton_d256_every_table_entry(monkeypatch):
    """Each entry of the D = 256 tables (forward, dK/dV, dQ: the i-th of each pinned together; the sm_90 Gluon forward
    off) that fits this card's shared memory, against the references: causal with odd lengths and a bidirectional call with Sq != Sk."""
    from pykernels._kernels import _launch
    from pykernels._kernels import _tuning
    from pykernels._kernels import attention as tri
    limit = _tuning.device_properties(torch.device("cuda")).shared_memory_per_block_optin
    assert limit >= 48 * 1024, limit
    kernels = {"fwd": tri._attention_fwd_kernel, "dkdv": tri._attention_bwd_dkdv_kernel,
               "dq": tri._attention_bwd_dq_kernel}
    q, k, v = _inputs((2, 4, 300, 256), (2, 2, 300, 256), (2, 2, 300, 256), BF16, "cuda")
    q2, k2, v2 = _inputs((1, 2, 77, 256), (1, 2, 400, 256), (1, 2, 400, 256), BF16, "cuda")
    ran = 0
    for i in range(max(len(tri._TABLE[kind][256]) for kind in kernels)):
        monkeypatch.setenv("PYKERNELS_ATTN_SM90", "0")  # the Triton forward (the Gluon one takes D = 256 on Hopper)
        for kind, kern in kernels.items():
            table = tri._TABLE[kind][256]
            entry = table[min(i, len(table) - 1)]
            if tri._SMEM_256[kind][entry][0] > limit:
                entry = table[-1]
            monkeypatch.setitem(tri._TABLE[kind], 256, [entry])
            kern.cache.clear()
            _launch.fast(kern).cache.clear()
        _check_against_ref(q, k, v, causal=True, enable_gqa=True, what=f"entry {i} causal")
        _check_against_ref(q2, k2, v2, what=f"entry {i} 77x400")
        ran += 1
        monkeypatch.undo()
    for kern in kernels.values():
        kern.cache.clear()
        _launch.fast(kern).cache.clear()
    assert ran == 4


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk,causal", [(1, 1000, True), (1000, 777, True), (777, 1000, True),
                                          (127, 4097, True)])
def test_gpu_bf16_uneven_gqa(sq, sk, causal):
    q, k, v = _inputs((2, 8, sq, 128), (2, 2, sk, 128), (2, 2, sk, 128), BF16, "cuda")
    _check_against_ref(q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_gpu_bert_key_padding_and_torch_math(dtype):
    b, h, s, d = 4, 12, 512, 64
    lengths = torch.tensor([512, 300, 257, 1], device="cuda")
    mask = (torch.arange(s, device="cuda")[None, :] < lengths[:, None]).view(b, 1, 1, s)
    q, k, v = _inputs((b, h, s, d), (b, h, s, d), (b, h, s, d), dtype, "cuda")
    out, _ = _check_against_ref(q, k, v, mask=mask)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_masks_gqa_dropout_bf16():
    b, hq, hkv, s, d = 2, 8, 2, 300, 128
    q, k, v = _inputs((b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d), BF16, "cuda")
    _check_against_ref(q, k, v, mask=torch.randn(1, hq, s, s, device="cuda", dtype=BF16), causal=True)
    _check_against_ref(q, k, v, mask=torch.rand(b, 1, s, s, device="cuda") > 0.5)
    torch.manual_seed(11)
    seed = new_seed(q.device)
    torch.manual_seed(11)
    out = sdpa(q, k, v, dropout_p=0.1, is_causal=True, backend="triton")
    dmask = attention_dropout_mask(seed, b, hq, s, s, 0.1, "cuda")
    do = torch.randn_like(out)
    _, grads = _check_against_ref(q, k, v, causal=True, dropout_p=0.1, dropout_mask=dmask, out=out, do=do)
    # Same seed again: bitwise-identical output and gradients (deterministic backward, no atomics).
    torch.manual_seed(11)
    out2 = sdpa(q, k, v, dropout_p=0.1, is_causal=True, backend="triton", deterministic=True)
    assert torch.equal(out, out2)
    for a, b_ in zip(grads, _grads(out2, (q, k, v), do)):
        assert torch.equal(a, b_)


def _pin_triton_dropout_configs(monkeypatch):
    """One config a Triton kernel for every dropout draw (the PTX draws have their own tables, and the autotuner times
    each key: tiles of another shape sum in another order), the kernels' remembered choices forgotten; the Triton
    dK/dV kernel at D = 128 too (not the Gluon one)."""
    from pykernels._kernels import _launch
    from pykernels._kernels import attention as tri
    from pykernels._kernels import attention_sm90_bwd as kb
    monkeypatch.setattr(kb, "DROPOUT_KERNELS", False)
    for table, src in (("dq_dropout", "dq_dropout_ptx"), ("dkdv_dropout", "dkdv_dropout_ptx"),
                       ("fwd_short", "fwd_short")):
        for tier in (64, 128):
            one = [tri._TABLE[src][tier][0]]
            monkeypatch.setitem(tri._TABLE[table], tier, one)
            monkeypatch.setitem(tri._TABLE[src], tier, one)
    for kern in (tri._attention_fwd_kernel, tri._attention_bwd_dq_kernel, tri._attention_bwd_dkdv_kernel):
        kern.cache.clear()
        _launch.fast(kern).cache.clear()


def _over_triton_dropout_draws(monkeypatch, d, call):
    """``call(seed, what)`` three times, the Triton kernels getting their keep bits each way: the PTX draws with the
    keep buffer (``keep_buffer``: the dQ kernel stores, the dK/dV kernel loads), the PTX draws in both kernels (the
    cap 0), ``dropout_keep``'s draws; each with the same torch seed, whose op seed ``call`` gets. Checks that the first backward took the buffer, the second was refused it,
    and none asked for one above ``KEEP_BUFFER_MAX_D``; returns the three results."""
    from pykernels._kernels import attention as tri
    buffers = []
    keep_buffer = tri.keep_buffer
    monkeypatch.setattr(tri, "keep_buffer", lambda *a: buffers.append(keep_buffer(*a)) or buffers[-1])
    results = []
    for ptx, keep_mb in ((True, 1024), (True, 0), (False, 1024)):
        monkeypatch.setattr(tri, "PTX_DROPOUT", ptx)
        monkeypatch.setattr(tri, "KEEP_BUFFER_MB", keep_mb)
        torch.manual_seed(7)
        seed = new_seed(torch.device("cuda"))
        torch.manual_seed(7)
        results.append(call(seed, f"ptx {ptx} keep buffer {keep_mb}"))
    assert [x is not None for x in buffers] == ([True, False] if d <= tri.KEEP_BUFFER_MAX_D else [])
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,hq,hkv,sq,sk", [(64, False, 4, 4, 512, 512), (64, True, 4, 2, 1000, 1000),
                                                  (80, False, 2, 1, 127, 300), (128, True, 2, 2, 257, 257)])
def test_gpu_triton_dropout_keep_bits_stored_by_the_forward(monkeypatch, d, causal, hq, hkv, sq, sk):
    """``attention_fwd``'s ``keep``: the forward stores its PTX draws' keep bits in a ``keep_buffer`` and
    ``attention_bwd``'s ``keep`` loads them in both backward kernels: the same output and gradients bitwise as the
    draws (one config a kernel), which the reference holds to the seed's mask; a case without PTX draws refuses it."""
    from pykernels._kernels import attention as tri
    _pin_triton_dropout_configs(monkeypatch)
    b, p, sc = 2, 0.23, d ** -0.5
    q, k, v = _inputs((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), BF16, "cuda")
    do = torch.randn(b, hq, sq, d, dtype=BF16, device="cuda")
    seed = torch.tensor([4242], dtype=torch.int64, device="cuda")
    o, lse = tri.attention_fwd(q, k, v, None, causal=causal, scale=sc, dropout_p=p, seed=seed)
    grads = tri.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc, dropout_p=p, seed=seed)
    keep = tri.keep_buffer(b, hq, sq, sk, q.device)
    keep[0].fill_(0x5A)  # (poison: every byte the backward reads must be one the forward stored)
    o2, lse2 = tri.attention_fwd(q, k, v, None, causal=causal, scale=sc, dropout_p=p, seed=seed, keep=keep)
    grads2 = tri.attention_bwd(do, q, k, v, o2, lse2, None, causal=causal, scale=sc, dropout_p=p, seed=seed,
                               keep=keep)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    for name, a, c in zip(("dq", "dk", "dv"), grads, grads2):
        assert torch.equal(a, c), name
    with pytest.raises(ValueError, match="keep"):
        tri.attention_fwd(q.float(), k.float(), v.float(), None, causal=causal, scale=sc, dropout_p=p, seed=seed,
                          keep=keep)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_triton_varlen_dropout_keep_buffer(monkeypatch, d):
    """Varlen with dropout through the Triton backward's keep buffer (heads of max_seqlen rows, empty and one-row
    sequences, GQA): bitwise the gradients of the PTX draws without it and of dropout_keep's draws, and one
    sequence's output and gradients against the float64 reference with its slice of attention_dropout_mask."""
    _pin_triton_dropout_configs(monkeypatch)
    lq = lk = [300, 1, 0, 130, 77]
    q, k, v, cu_q, cu_k = _varlen_case(lq, lk, 4, 2, d, BF16, "cuda")
    do = torch.randn(q.shape[0], 4, d, dtype=BF16, device="cuda")

    def call(seed, what):
        out = varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), dropout_p=0.2, causal=True, backend="triton")
        return seed, out, *_grads(out, (q, k, v), do)
    results = _over_triton_dropout_draws(monkeypatch, d, call)
    seed, runs = results[0][0], [r[1:] for r in results]
    for other in runs[1:]:
        for name, a, b in zip(("out", "dq", "dk", "dv"), runs[0], other):
            assert torch.equal(a, b), name
    dmask = attention_dropout_mask(seed, len(lq), 4, max(lq), max(lk), 0.2, "cuda")
    i = 3
    qs, qe = int(cu_q[i]), int(cu_q[i + 1])
    seq = lambda t: t.detach()[qs:qe].transpose(0, 1)[None]  # noqa: E731  ((1, H, L, D) of sequence i)
    keep = dmask[i:i + 1, :, :qe - qs, :qe - qs]

    def ref(dt):
        qq, kk, vv = (seq(t).to(dt).requires_grad_(True) for t in (q, k, v))
        o = attention_reference(qq, kk, vv, None, 0.2, True, None, True, dropout_mask=keep)
        return o, _grads(o, (qq, kk, vv), seq(do).to(dt))
    (o_hi, g_hi), (o_lo, g_lo) = ref(torch.float64), ref(BF16)
    out, *grads = runs[0]
    assert_close_to_ref("varlen keep buffer out", seq(out), o_hi, o_lo)
    # dq of the sequence's rows; dk / dv of its keys (only its own queries see them)
    for name, a, b, c in zip(("dq", "dk", "dv"), grads, g_hi, g_lo):
        assert_close_to_ref(f"varlen keep buffer {name}", seq(a), b, c)


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,hq,hkv,sq,sk,dtype,mask", [
    (64, False, 4, 4, 512, 512, BF16, None), (64, True, 4, 2, 1000, 1000, BF16, None),
    (64, False, 2, 2, 300, 257, F16, "pad"), (16, False, 2, 2, 17, 127, F16, None), (32, False, 2, 1, 1, 33, BF16, None),
    (80, True, 4, 1, 127, 300, BF16, None), (96, False, 2, 2, 257, 1000, F16, "bool"),
    (128, True, 2, 2, 300, 300, BF16, None), (128, False, 2, 2, 200, 129, F16, None)])
def test_gpu_triton_dropout_ptx_draws_dropout_keeps_mask(monkeypatch, d, causal, hq, hkv, sq, sk, dtype, mask):
    # The Triton backward's keep bits by inline PTX (PTX_DROPOUT: the dK/dV kernel's octets, the dQ kernel's quads)
    # against the reference with attention_dropout_mask of the seed, and bitwise the gradients of dropout_keep's
    # draws (PTX_DROPOUT off: the same mask, the same arithmetic); odd lengths, GQA, head dims 16..128, masks. The PTX
    # draws both with the keep buffer (the dQ kernel stores its bits, the dK/dV kernel loads them) and without
    from pykernels._kernels import attention as tri
    _pin_triton_dropout_configs(monkeypatch)
    b, p = 2, 0.17
    q, k, v = _inputs((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), dtype, "cuda")
    m = None
    if mask == "pad":
        m = torch.arange(sk, device="cuda")[None, None, None, :] < torch.tensor([sk, sk // 3], device="cuda")[:, None,
                                                                                                              None, None]
    elif mask == "bool":
        m = torch.rand(b, 1, sq, sk, device="cuda") > 0.3
    assert tri._ptx_dropout(q, v, b * hq * sq, p, 5)
    do = torch.randn(b, hq, sq, d, dtype=dtype, device="cuda")

    def call(seed, what):
        out = sdpa(q, k, v, m, dropout_p=p, is_causal=causal, enable_gqa=hkv != hq, backend="triton")
        dmask = attention_dropout_mask(seed, b, hq, sq, sk, p, "cuda")
        return _check_against_ref(q, k, v, mask=m, causal=causal, dropout_p=p, dropout_mask=dmask, out=out, do=do,
                                  enable_gqa=hkv != hq, what=what)
    (o1, g1), *others = _over_triton_dropout_draws(monkeypatch, d, call)
    for o2, g2 in others:
        assert torch.equal(o1, o2)
        for name, a, c in zip(("dq", "dk", "dv"), g1, g2):
            assert torch.equal(a, c), name


@pytest.mark.gpu
def test_gpu_varlen_bf16_and_deterministic():
    lq = [1000, 1, 0, 513, 77]
    q, k, v, cu_q, cu_k = _varlen_case(lq, lq, 8, 2, 128, BF16, "cuda", extra_rows=5)
    do = None
    runs = []
    for _ in range(2):
        out = varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lq), causal=True, backend="triton",
                               deterministic=True)
        do = torch.randn_like(out) if do is None else do
        runs.append(_grads(out, (q, k, v), do))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    i = 3
    qs, qe = int(cu_q[i]), int(cu_q[i + 1])

    def seq(dt):
        qq, kk, vv = (t.detach()[qs:qe].to(dt).transpose(0, 1) for t in (q, k, v))
        return attention_reference(qq, kk, vv, is_causal=True).transpose(0, 1)

    assert_close_to_ref("varlen out", out[qs:qe], seq(torch.float64), seq(BF16))


@pytest.mark.gpu
def test_gpu_int64_offsets():
    """More than 2**31 elements per tensor: offsets must be int64. Checks the last batches."""
    b, h, s, d = 8192, 16, 136, 128  # 2.28e9 elements per tensor (4.6 GB in bf16)
    torch.manual_seed(0)
    q = torch.randn(b, h, s, d, device="cuda", dtype=BF16)
    k = torch.randn(b, h, s, d, device="cuda", dtype=BF16)
    v = torch.randn(b, h, s, d, device="cuda", dtype=BF16)
    out = sdpa(q, k, v, is_causal=True, backend="triton")
    tail = slice(b - 2, b)
    ref_hi = attention_reference(q[tail].double(), k[tail].double(), v[tail].double(), is_causal=True)
    ref_lo = attention_reference(q[tail], k[tail], v[tail], is_causal=True)
    assert_close_to_ref("out tail", out[tail], ref_hi, ref_lo)
    del out
    qg, kg, vg = (t.requires_grad_(True) for t in (q, k, v))
    out = sdpa(qg, kg, vg, is_causal=True, backend="triton")
    do = torch.randn_like(out)
    dq, dk, dv = _grads(out, (qg, kg, vg), do)
    del out

    def ref(dt):
        qq, kk, vv = (t.detach()[tail].to(dt).requires_grad_(True) for t in (q, k, v))
        o = attention_reference(qq, kk, vv, is_causal=True)
        return _grads(o, (qq, kk, vv), do[tail].to(dt))

    for name, a, hi, lo in zip(("dq", "dk", "dv"), (dq[tail], dk[tail], dv[tail]), ref(torch.float64), ref(BF16)):
        assert_close_to_ref(name, a, hi, lo)


@pytest.mark.gpu
def test_gpu_backward_under_another_process_load():
    """With another process's kernels on the GPU, the driver time-slices and preempts running CTAs. The sm_90
    dK/dV kernel once gave a dead mbarrier's shared memory to values its partitions capture, and every run
    of this case beside a matmul loop then died of an illegal address (none alone; run101-106)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hog_py = os.path.join(root, "benchmarks", "dev", "gpu_hog.py")  # matmuls in a loop, 1 GiB held
    hog = subprocess.Popen([sys.executable, hog_py, "60", "1"], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().strip() == "ready", "the load process did not start"
        b, h, s, d = 1024, 16, 136, 128  # causal: the longest-first dK/dV grid, a key tail in every head
        q, k, v = _inputs((b, h, s, d), (b, h, s, d), (b, h, s, d), BF16, "cuda")
        for _ in range(2):
            out = sdpa(q, k, v, is_causal=True, backend="triton")
            do = torch.randn_like(out)
            grads = _grads(out, (q, k, v), do)
            torch.cuda.synchronize()
        tail = slice(b - 2, b)
        qq, kk, vv = (t.detach()[tail].double().requires_grad_(True) for t in (q, k, v))
        ref = _grads(attention_reference(qq, kk, vv, is_causal=True), (qq, kk, vv), do[tail].double())
        lo = [t.detach()[tail].requires_grad_(True) for t in (q, k, v)]
        ref_lo = _grads(attention_reference(*lo, is_causal=True), lo, do[tail])
        for name, g, r, rl in zip(("dq", "dk", "dv"), grads, ref, ref_lo):
            assert_close_to_ref(name, g[tail], r, rl)
    finally:
        hog.kill()
        hog.wait()


@pytest.mark.gpu
def test_gpu_auto_falls_back_with_warning(monkeypatch):
    import pykernels._backend as be
    monkeypatch.setattr(be, "_warned", set())  # (once per process: a fresh record, whatever ran before)
    q, k, v = _inputs((1, 2, 64, 320), (1, 2, 64, 320), (1, 2, 64, 320), BF16, "cuda", requires_grad=False)
    with pytest.warns(FallbackWarning, match="head dim 320"):
        out = sdpa(q, k, v, backend="auto")
    torch.testing.assert_close(out, attention_reference(q, k, v))
    with pytest.raises(BackendUnavailableError, match="head dim 320"):
        sdpa(q, k, v, backend="triton")


@pytest.mark.gpu
def test_gpu_compile_inductor():
    q, k, v = _inputs((2, 4, 256, 128), (2, 4, 256, 128), (2, 4, 256, 128), BF16, "cuda")
    f = lambda q, k, v: sdpa(q, k, v, is_causal=True, backend="triton")  # noqa: E731
    out_c = torch.compile(f, fullgraph=True)(q, k, v)
    torch.testing.assert_close(out_c, f(q, k, v))


@pytest.mark.parametrize("shape,ok", [((4,), True), ((1, 4), True), ((3, 1, 4), True), ((2, 3, 5, 4), True),
                                      ((2, 1, 1, 1), True), ((5,), False), ((2, 3, 1, 4), True), ((2, 3, 2, 4), False),
                                      ((1, 2, 3, 5, 4), False), ((4, 3, 5, 4), False)])
def test_mask_broadcast_check_agrees_with_torch(shape, ok):
    # the attention entry point checks mask broadcasting with plain ints (torch.broadcast_shapes is slow
    # on the host); it must agree with torch's rule "broadcasts to exactly (B, H, Sq, Sk)"
    from pykernels.attention import _broadcasts_to
    full = (2, 3, 5, 4)
    try:
        want = torch.broadcast_shapes(shape, full) == torch.Size(full)
    except RuntimeError:
        want = False
    assert want == ok
    assert _broadcasts_to(torch.Size(shape), full) == ok


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_output_and_gradients_keep_the_transformers_layout(device, backend):
    # q/k/v as the (B, S, H, D).transpose(1, 2) views transformers passes: the output and the gradients
    # come back in that memory order (so reshaping them back costs no copy), on every backend alike
    # (the fake impl promises the same strides to torch.compile).
    dtype = BF16 if device.type == "cuda" else F16  # (the interpreter's bf16 tl.dot is wrong)
    base = [torch.randn(2, 17, 4, 32, dtype=dtype, device=device, requires_grad=True) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in base)
    out = sdpa(q, k, v, is_causal=True, backend=backend)
    assert out.stride() == q.stride()
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for g, t in zip(grads, (q, k, v)):
        assert g.stride() == t.stride()
    _check_against_ref(q, k, v, causal=True, backend=backend, what=backend)


def test_varlen_rows_no_program_writes_are_zero(device):
    # Rows past cu_seqlens[-1], and rows beyond a max_seqlen that is smaller than a real length (the
    # documented result of that misuse), come out exactly 0 in the output and in all three gradients,
    # never uninitialised (outputs are NaN-poisoned in the tests before the kernels run).
    dtype = BF16 if device.type == "cuda" else F16
    lens = [5, 0, 23, 9]
    cu = torch.tensor([0, 5, 5, 28, 37], dtype=torch.int32, device=device)
    total = 37 + 6  # 6 tail rows that belong to no sequence
    q, k, v = _inputs((total, 4, 32), (total, 2, 32), (total, 2, 32), dtype, device)
    max_len = 16  # < 23: rows 16..22 of the third sequence are past max_seqlen
    out = varlen_attention(q, k, v, cu, cu, max_len, max_len, backend="triton")
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    uncovered = torch.zeros(total, dtype=torch.bool, device=device)
    uncovered[37:] = True
    uncovered[5 + 16:28] = True
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t).all(), name
        assert (t[uncovered] == 0).all(), name
        assert (t[~uncovered].abs().sum(dim=(-1, -2)) > 0).all(), name  # the covered rows were computed
    assert sum(lens) == 37


def test_varlen_zero_uncovered_kernel_binary_search(device):
    # the row -> sequence search over cu_seqlens, with empty sequences and many batches
    from pykernels._kernels import attention as kattn
    lens = torch.randint(0, 7, (50,))
    lens[::7] = 0
    cu = torch.zeros(51, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    total = int(cu[-1]) + 5
    x = torch.full((total, 2, 3), float("nan"), device=device)
    max_len = 4
    kattn._zero_uncovered(x, None, cu.to(device), max_len)
    seq = torch.searchsorted(cu, torch.arange(total, dtype=torch.int32), right=True) - 1
    pos = torch.arange(total) - cu[seq.clamp(max=50)]
    want_zero = (torch.arange(total) >= int(cu[-1])) | (pos >= max_len)
    got = x.cpu()
    assert (got[want_zero] == 0).all()
    assert torch.isnan(got[~want_zero]).all()  # covered rows untouched


# ---------------------------------------------------------------------------------------------
# sm_90 (Hopper): the Gluon warp-specialised forward (kernels/attention_sm90.py) that the dense
# forward takes at D = 128 with long keys, and the Gluon backward (kernels/attention_sm90_bwd.py) at D = 128
# ---------------------------------------------------------------------------------------------
def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


sm90_only = pytest.mark.skipif(not _is_sm90(), reason="needs an sm_90 (Hopper) GPU")


def _spy_sm90_bwd_kernels(monkeypatch) -> list:
    """(name, launched) of every call of the Gluon backward's two entry points, in order."""
    from pykernels._kernels import attention_sm90_bwd as kb
    ran = []
    for name in ("attention_bwd_dkdv_sm90", "attention_bwd_dq_sm90"):
        def spy(*a, _f=getattr(kb, name), _n=name, **kw):
            took = _f(*a, **kw)
            ran.append((_n, took))
            return took
        monkeypatch.setattr(kb, name, spy)
    return ran


def _sm90_inputs(b, hq, hkv, sq, sk, dtype, layout, d=128):
    """q, k, v leaves (requires_grad) of (B, H, S, D) shapes: contiguous ("bhsd"), transformers' transposed (B, S, H, D)
    views ("bshd"), or q contiguous with k / v in those views ("kv_bshd")."""
    def make(h, s, kv=False):
        if layout == "bshd" or (kv and layout == "kv_bshd"):  # a transposed view of (B, S, H, D), as transformers
            leaf = torch.randn(b, s, h, d, dtype=dtype, device="cuda", requires_grad=True)
            return leaf.transpose(1, 2)
        return torch.randn(b, h, s, d, dtype=dtype, device="cuda", requires_grad=True)
    return make(hq, sq), make(hkv, sk, True), make(hkv, sk, True)


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("b,hq,hkv,sq,sk,causal", [
    (2, 4, 4, 1024, 1024, False), (1, 4, 2, 1000, 1500, True), (2, 2, 1, 1, 2048, True),
    (1, 2, 2, 2049, 1024, True), (1, 2, 2, 127, 1031, False)])
def test_gpu_sm90_gluon_forward(monkeypatch, dtype, layout, b, hq, hkv, sq, sk, causal):
    from pykernels._kernels import attention as katt
    q, k, v = _sm90_inputs(b, hq, hkv, sq, sk, dtype, layout)
    assert katt.sm90_forward(q, k, v, None, dropout_p=0.0, scale=128 ** -0.5), "this case must take the sm_90 kernel"
    do = torch.randn(b, hq, sq, 128, dtype=dtype, device="cuda")
    # the backward's Gluon kernels too (dK/dV declines a Q tile taller than Sq: Sq = 1 runs Triton's)
    monkeypatch.setenv("PYKERNELS_ATTN_SM90_BWD", "dkdv,dq")
    _check_against_ref(q, k, v, causal=causal, enable_gqa=hq != hkv, do=do, what="sm90")


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,pattern", [
    (3, 4, 4, 512, 512, 64, "prefix"),      # BERT-like lengths, the last batch without a valid key
    (2, 4, 2, 1000, 1500, 128, "holes"),    # GQA; leading keys masked (lo > 0) and random holes
    (2, 2, 2, 127, 1031, 64, "short"),      # the key tail; one batch sees key 0 only
    (2, 2, 2, 1, 2048, 128, "prefix"),      # Sq = 1
    # D = 64 takes its own tiles (128 rows x 64 keys per warpgroup, ``KEY_PAD_CONFIGS``): odd lengths there
    # (the auto path takes the kernel at D = 64 from Sk = 512: ``attention_sm90.preferred``)
    (2, 4, 2, 1000, 777, 64, "holes"),
    (2, 3, 3, 17, 530, 64, "short"),
    (2, 2, 2, 1, 600, 64, "prefix"),
    (2, 4, 2, 1000, 777, 96, "holes")])  # D = 96 on the D = 128 tiles (``attention_sm90.TILE_D``)
def test_gpu_sm90_gluon_forward_key_padding(layout, b, hq, hkv, sq, sk, d, pattern):
    """The Gluon forward with a boolean key-padding mask: only the batch's valid key blocks, masked keys
    inside them; a batch without a valid key gives O = 0 (lse -inf, never NaN). The backward is Triton's."""
    from pykernels._kernels import attention as katt
    from pykernels.attention import _key_padding_range
    g = torch.Generator().manual_seed(sk)
    keep = torch.ones(b, sk, dtype=torch.bool)
    if pattern == "prefix":
        lens = [sk, sk // 2 + 44, 0][:b]
        keep = torch.arange(sk)[None, :] < torch.tensor(lens)[:, None]
    elif pattern == "holes":
        keep = torch.rand(b, sk, generator=g) > 0.3
        keep[0, :200] = False  # the first valid key past the first block
        keep[1, 1300:] = False
    else:
        keep[1, 1:] = False
    mask = keep[:, None, None, :].cuda()
    q, k, v = _sm90_inputs(b, hq, hkv, sq, sk, BF16, layout, d=d)
    m4 = mask.expand(b, hq, sq, sk)
    kv_range = _key_padding_range(m4)
    assert katt.sm90_forward(q, k, v, m4, dropout_p=0.0, scale=d ** -0.5, kv_range=kv_range), \
        "this case must take the sm_90 kernel"
    out, _ = _check_against_ref(q, k, v, mask=mask, enable_gqa=hq != hkv, what=f"sm90 key padding {pattern}")
    assert torch.isfinite(out).all()
    if pattern == "prefix" and b == 3:
        assert (out[2] == 0).all()
    # the same forward through the kernel entry point, bitwise
    o2, lse2 = katt.attention_fwd(q.detach(), k.detach(), v.detach(), m4, causal=False, scale=d ** -0.5,
                                  dropout_p=0.0, seed=0, kv_range=kv_range)
    assert torch.equal(o2, out.detach())
    if pattern == "prefix" and b == 3:
        assert torch.isneginf(lse2[2]).all()


def _three_batch_key_padding(b, hq, sq, sk):
    """(mask (B, 1, 1, Sk), its (B, Hq, Sq, Sk) view, the key range) of a boolean key-padding mask over b = 3 batches:
    every key, the first Sk // 2 + 3, none (the batch without a valid key: output and gradients 0)."""
    from pykernels.attention import _key_padding_range
    lens = torch.tensor([[sk], [sk // 2 + 3], [0]], device="cuda")
    mask = (torch.arange(sk, device="cuda")[None, :] < lens).view(b, 1, 1, sk)
    m4 = mask.expand(b, hq, sq, sk)
    return mask, m4, _key_padding_range(m4)


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("dtype,layout,b,hq,hkv,sq,sk,causal,pattern", [
    (BF16, "bhsd", 4, 16, 16, 1024, 1024, False, None),  # 512 tiles: each persistent CTA walks ~4 (one Q tile each)
    (BF16, "bshd", 2, 16, 4, 1024, 1024, True, None),    # GQA causal on the host's tile table
    (F16, "bhsd", 1, 4, 2, 1000, 1500, True, None),      # Sq != Sk, odd lengths; fp16
    (BF16, "bshd", 2, 2, 1, 1, 2048, True, None),        # Sq = 1
    (BF16, "bhsd", 1, 2, 2, 127, 1031, False, None),     # the query and key tails
    (BF16, "bshd", 3, 4, 2, 1000, 777, False, "keys"),   # key padding, the last batch without a valid key
])
@pytest.mark.parametrize("d", [256, 192])
def test_gpu_sm90_gluon_forward_d256(dtype, layout, b, hq, hkv, sq, sk, causal, pattern, d):
    """The Gluon forward at D = 256 (64 x 64 tiles a warpgroup, one Q tile a warpgroup: ``attention_sm90.q_bufs``)
    and at D = 192 on the same tiles over 192-column descriptors (``attention_sm90.TILE_D``: host ones for the
    (B, H, S, D) rows, device-made ones for the (B, S, H, D) views) against the float64 reference, forward and
    gradients (D = 256: Triton's backward on its lse; D = 192 (B, H, S, D): the Gluon dK/dV kernel beside Triton's
    dQ); bitwise the same through the kernel entry point; a batch without a valid key gives 0."""
    from pykernels._kernels import attention as katt
    from pykernels._kernels import attention_sm90
    cfg = attention_sm90.CONFIGS[d]
    assert attention_sm90.q_bufs(*cfg, 256) == 1  # (the two-tile Q ring does not fit beside the K/V ring)
    q, k, v = _sm90_inputs(b, hq, hkv, sq, sk, dtype, layout, d=d)
    mask, m4, kv_range = _three_batch_key_padding(b, hq, sq, sk) if pattern == "keys" else (None, None, None)
    assert katt.sm90_forward(q, k, v, m4, dropout_p=0.0, scale=d ** -0.5, kv_range=kv_range, causal=causal), \
        "this case must take the sm_90 kernel"
    plan = attention_sm90.forward_plan(q, k, v, causal=causal, scale=d ** -0.5, key_pad=mask is not None)
    assert plan.kwargs["HEAD_D"] == 256 and plan.kwargs["D_COLS"] == (192 if d == 192 else 0)
    if d == 192:  # host descriptors only where every head starts at column 0 of its rows
        assert (plan.geo is not None) == (layout == "bhsd"), plan.geo
    out, grads = _check_against_ref(q, k, v, mask=mask, causal=causal, enable_gqa=hq != hkv, what=f"sm90 d{d}")
    assert torch.isfinite(out).all()
    o2, lse2 = katt.attention_fwd(q.detach(), k.detach(), v.detach(), m4, causal=causal, scale=d ** -0.5,
                                  dropout_p=0.0, seed=0, kv_range=kv_range)
    assert torch.equal(o2, out.detach())
    if pattern == "keys":
        assert (out[2] == 0).all() and torch.isneginf(lse2[2]).all()
        assert all((g[2] == 0).all() for g in grads)


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("dtype,layout,b,hq,hkv,sq,sk,causal,pattern", [
    (BF16, "bhsd", 4, 16, 16, 1024, 1024, False, None),  # host descriptors, persistent CTAs
    (BF16, "bshd", 2, 16, 4, 1024, 1024, True, None),    # GQA causal; the CTAs' own descriptors
    (F16, "bhsd", 1, 4, 2, 1000, 1500, True, None),      # Sq != Sk, odd lengths; fp16
    (BF16, "bhsd", 2, 2, 1, 1, 2048, True, None),        # Sq = 1
    (BF16, "bhsd", 3, 4, 2, 1000, 777, False, "keys"),   # key padding, the last batch without a valid key
])
def test_gpu_sm90_forward_d192_split(monkeypatch, dtype, layout, b, hq, hkv, sq, sk, causal, pattern):
    """The D = 192 forward on its columns' two blocks (``attention_sm90.SPLIT_D``, the default: QK^T over 128 + 64
    columns, O as 128- and 64-column accumulators, no GEMM on the 256-wide tile's zero columns) against the float64 reference
    and eager's error, forward and (Triton / Gluon backward on its lse) gradients, and close to the padded kernel's
    output (the same k-steps in the same order: equal in practice, not asserted bitwise); a batch without a valid
    key gives 0."""
    from pykernels._kernels import attention as katt
    from pykernels._kernels import attention_sm90 as a9
    q, k, v = _sm90_inputs(b, hq, hkv, sq, sk, dtype, layout, d=192)
    mask, m4, kv_range = _three_batch_key_padding(b, hq, sq, sk) if pattern == "keys" else (None, None, None)
    args = (q.detach(), k.detach(), v.detach(), m4)
    kw = dict(causal=causal, scale=192 ** -0.5, dropout_p=0.0, seed=0, kv_range=kv_range)
    monkeypatch.setattr(a9, "SPLIT_D", False)  # the GEMMs on the whole 256-wide tiles
    padded, _ = katt.attention_fwd(*args, **kw)
    monkeypatch.setattr(a9, "SPLIT_D", True)
    plan = a9.forward_plan(q, k, v, causal=causal, scale=192 ** -0.5, key_pad=mask is not None)
    assert (plan.kwargs["D_A"], plan.kwargs["D_B"], plan.kwargs["D_COLS"]) == (128, 64, 192)
    out, grads = _check_against_ref(q, k, v, mask=mask, causal=causal, enable_gqa=hq != hkv, what="sm90 d192 split")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.detach(), padded, rtol=0, atol=2e-3 if dtype == F16 else 1.6e-2)
    if pattern == "keys":
        assert (out[2] == 0).all() and all((g[2] == 0).all() for g in grads)


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("layout", ["packed", "qkv"])
@pytest.mark.parametrize("lens,hq,hkv,d,causal", [
    ([512, 300, 0, 17, 511, 1], 4, 4, 64, False),   # BERT-like lengths, an empty sequence, lengths 17 and 1
    ([1000, 127, 256, 129], 4, 2, 128, False),     # GQA; lengths on both sides of the 128-row tiles
    ([384, 0], 2, 2, 128, False),                  # the last sequence empty: its rows past cu[-2] are zero
    ([1000, 127, 0, 256, 129, 1], 4, 2, 128, True),  # causal (GPT-style packing), GQA
    ([700, 17, 300], 2, 2, 64, True)])
def test_gpu_sm90_gluon_varlen_forward(monkeypatch, layout, lens, hq, hkv, d, causal):
    """The Gluon forward on packed varlen sequences (``attention_sm90.attention_fwd_sm90_varlen``; causal: top-left
    in each sequence, as the Triton kernel and torch):
    every sequence equal to the reference on its own rows, rows past cu_seqlens[-1] zero, and the backward
    (Triton's, on this forward's lse) equal to the reference per sequence. "qkv": q, k, v are head slices of
    one packed projection (T, Hq + 2 Hkv, D), so their token stride is not H * D. At D = 64 (covered, but
    the rule keeps the Triton kernel there) the rule is widened for the test."""
    from pykernels._kernels import attention as katt
    from pykernels._kernels import attention_sm90
    monkeypatch.setattr(attention_sm90, "VARLEN_HEAD_DIMS", (64, 128))
    extra = 5
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    t = int(cu[-1]) + extra
    if layout == "packed":
        q, k, v = _inputs((t, hq, d), (t, hkv, d), (t, hkv, d), BF16, "cuda")
    else:
        qkv = torch.randn(t, hq + 2 * hkv, d, device="cuda", dtype=BF16)
        q, k, v = (x.detach().requires_grad_(True) for x in (qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]))
    cu = cu.cuda()
    mx = max(lens)
    assert katt.sm90_varlen_forward(q, k, v, cu, cu, mx, mx, dropout_p=0.0, scale=d ** -0.5, causal=causal), \
        "this case must take the sm_90 kernel"
    out = varlen_attention(q, k, v, cu, cu, mx, mx, causal=causal, backend="triton")
    do = torch.randn_like(out)
    dq, dk, dv = _grads(out, (q, k, v), do)
    end = int(cu[-1])
    for name, g in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(g).all(), name
        assert torch.equal(g[end:], torch.zeros_like(g[end:])), name
    _check_varlen_per_sequence(out, (dq, dk, dv), q, k, v, do, cu, cu, causal, BF16)


@pytest.mark.gpu
@sm90_only
def test_gpu_sm90_varlen_dispatch_rules(monkeypatch):
    """The varlen forward takes the Gluon kernel only where it covers the call and its rule prefers it."""
    from pykernels._kernels import attention as katt
    from pykernels._kernels import attention_sm90
    q, k, v = _inputs((600, 2, 128), (600, 2, 128), (600, 2, 128), BF16, "cuda", requires_grad=False)
    cu = torch.tensor([0, 300, 600], dtype=torch.int32, device="cuda")
    lens = (cu, cu, 512, 512)
    rule = dict(dropout_p=0.0, scale=0.125, causal=False)
    assert attention_sm90.VARLEN_HEAD_DIMS == (128,)
    assert katt.sm90_varlen_forward(q, k, v, *lens, **rule)
    assert katt.sm90_varlen_forward(q, k, v, cu, cu.view(-1), 512, 512, **rule)  # one memory, another tensor
    assert not katt.sm90_varlen_forward(q[..., :64], k[..., :64], v[..., :64], *lens, **rule)  # D = 64: Triton's
    assert katt.sm90_varlen_forward(q, k, v, *lens, **dict(rule, causal=True))
    assert not katt.sm90_varlen_forward(q, k, v, *lens, **dict(rule, dropout_p=0.1))
    assert not katt.sm90_varlen_forward(q[:100], k[:100], v[:100], *lens, **rule)  # fewer rows than a tile
    assert not katt.sm90_varlen_forward(q.float(), k.float(), v.float(), *lens, **rule)
    assert not katt.sm90_varlen_forward(q, k, v, cu, cu.clone(), 512, 512, **rule)  # cross-attention: Triton's
    assert not katt.sm90_varlen_forward(q, k, v, cu, cu, 512, 600, **rule)
    monkeypatch.setenv("PYKERNELS_ATTN_SM90", "0")
    assert not katt.sm90_varlen_forward(q, k, v, *lens, **rule)


@pytest.mark.gpu
@sm90_only
def test_gpu_sm90_key_padding_dispatch_rules():
    """Key padding takes the Gluon forward only as a boolean mask with its key range and not causal."""
    from pykernels._kernels import attention as katt
    from pykernels.attention import _key_padding_range
    q, k, v = _sm90_inputs(2, 2, 2, 512, 512, BF16, "bhsd")
    mask = (torch.arange(512, device="cuda")[None, :] < torch.tensor([[512], [300]], device="cuda"))
    m4 = mask[:, None, None, :].expand(2, 2, 512, 512)
    kv = _key_padding_range(m4)
    sc = 128 ** -0.5
    assert katt.sm90_forward(q, k, v, m4, dropout_p=0.0, scale=sc, kv_range=kv)
    assert not katt.sm90_forward(q, k, v, m4, dropout_p=0.0, scale=sc, kv_range=kv, causal=True)
    assert not katt.sm90_forward(q, k, v, m4, dropout_p=0.0, scale=sc)  # no key range: not key padding
    additive = torch.zeros(m4.shape, dtype=BF16, device="cuda").masked_fill(~m4, float("-inf"))
    assert not katt.sm90_forward(q, k, v, additive, dropout_p=0.0, scale=sc, kv_range=kv)
    assert not katt.sm90_forward(q, k, v, m4, dropout_p=0.1, scale=sc, kv_range=kv)
    _check_against_ref(q, k, v, mask=mask[:, None, None, :], causal=True, what="key padding causal (Triton)")


@pytest.mark.gpu
@sm90_only
def test_gpu_sm90_dispatch_rules(monkeypatch):
    from pykernels._kernels import attention as katt
    from pykernels._kernels import attention_sm90
    q, k, v = _sm90_inputs(1, 2, 2, 64, 1024, BF16, "bhsd")
    sc = 128 ** -0.5
    assert katt.sm90_forward(q, k, v, None, dropout_p=0.0, scale=sc)
    assert katt.sm90_forward(q, k[:, :, :17], v[:, :, :17], None, dropout_p=0.0, scale=sc)  # D = 128: any length
    q64, k64 = q[..., :64].contiguous(), torch.randn(1, 2, 4096, 64, dtype=BF16, device="cuda")
    # D = 64: without causal masking from 512 keys, causal from 1024
    for sk, causal, expected in ((1024, True, True), (512, True, False), (512, False, True), (256, False, False)):
        kk64 = k64[:, :, :sk]
        assert katt.sm90_forward(q64, kk64, kk64, None, dropout_p=0.0, scale=sc, causal=causal) == expected, (sk, causal)
    q80, k80, v80 = (t[..., :80].contiguous() for t in (q, k, v))
    assert katt.sm90_forward(q80, k80, v80, None, dropout_p=0.0, scale=sc)  # D = 80: the D = 128 kernel's tiles
    monkeypatch.setattr(attention_sm90, "D80_96", False)  # (PYKERNELS_ATTN_SM90_D80_96=0): Triton
    assert not katt.sm90_forward(q80, k80, v80, None, dropout_p=0.0, scale=sc)
    monkeypatch.setattr(attention_sm90, "D80_96", True)
    q256, k256 = (torch.randn(1, 2, n, 256, dtype=BF16, device="cuda") for n in (64, 1024))
    assert katt.sm90_forward(q256, k256, k256, None, dropout_p=0.0, scale=sc)  # D = 256: the Gluon forward
    # D = 192: the D = 256 kernel on 192 of its 256 columns (``attention_sm90.TILE_D``), here over rows 256 apart
    assert katt.sm90_forward(q256[..., :192], k256[..., :192], k256[..., :192], None, dropout_p=0.0, scale=sc)
    monkeypatch.setattr(attention_sm90, "D192", False)  # (PYKERNELS_ATTN_SM90_D192=0): the Triton forward
    assert not katt.sm90_forward(q256[..., :192], k256[..., :192], k256[..., :192], None, dropout_p=0.0, scale=sc)
    monkeypatch.setattr(attention_sm90, "D192", True)
    padded = [torch.randn(1, 2, n, 256, dtype=BF16, device="cuda", requires_grad=True)[..., :192]
              for n in (64, 1024, 1024)]
    plan = attention_sm90.forward_plan(*padded, causal=False, scale=sc)
    assert plan.geo is not None  # host descriptors
    assert (plan.kwargs.get("D_A", 0), plan.kwargs.get("D_B", 0)) == ((128, 64) if attention_sm90.SPLIT_D else (0, 0))
    _check_against_ref(*padded, what="D = 192 over rows 256 apart (the Gluon forward)")
    assert not katt.sm90_forward(q, k, v, None, dropout_p=0.1, scale=sc)
    assert not katt.sm90_forward(q.float(), k.float(), v.float(), None, dropout_p=0.0, scale=sc)
    assert not katt.sm90_forward(q, k[..., ::2].contiguous(), v, None, dropout_p=0.0, scale=sc)  # D 64 keys
    kk = torch.randn(1, 2, 1024, 136, dtype=BF16, device="cuda", requires_grad=True)[..., 3:131]  # base unaligned
    assert attention_sm90.unsupported(q, kk, v, None, dropout_p=0.0, scale=sc, varlen=False) == "strides not TMA-aligned"
    assert not katt.sm90_forward(q, kk, v, None, dropout_p=0.0, scale=sc)
    _check_against_ref(q, kk, v, what="unaligned k (Triton forward)")
    monkeypatch.setenv("PYKERNELS_ATTN_SM90", "0")
    assert not katt.sm90_forward(q, k, v, None, dropout_p=0.0, scale=sc)


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("layout,b,h,s,d,causal", [("bhsd", 4, 12, 512, 64, False), ("bshd", 2, 4, 1000, 128, True),
                                                   ("bshd", 2, 4, 777, 128, False)])
def test_gpu_eager_lane_sm90(monkeypatch, layout, b, h, s, d, causal):
    """The eager lane on the sm_90 kernel (its forward plan, cached per key): bit for bit the full path's
    outputs and gradients on two sets of inputs of one key, and within the accuracy rule."""
    from pykernels._kernels import attention as katt
    for _ in range(2):
        q, k, v = (t.detach().to(BF16).requires_grad_(True) if layout == "bhsd" else t
                   for t in _sm90_inputs(b, h, h, s, s, BF16, layout, d=d))
        assert katt.sm90_forward(q, k, v, None, dropout_p=0.0, scale=d ** -0.5, causal=causal)
        out, _, _, do = _lane_vs_full(monkeypatch, q, k, v, is_causal=causal)
        _check_against_ref(q, k, v, causal=causal, out=out, do=do, what="lane sm90")


@pytest.mark.gpu
@sm90_only
def test_gpu_sm90_forward_in_cuda_graph():
    q, k, v = (torch.randn(2, 4, 2048, 128, dtype=BF16, device="cuda") for _ in range(3))
    expected = sdpa(q, k, v, is_causal=True, backend="triton")
    static = [t.clone() for t in (q, k, v)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sdpa(*static, is_causal=True, backend="triton")  # warm up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = sdpa(*static, is_causal=True, backend="triton")
    for t in static:
        t.normal_()
    g.replay()
    assert not torch.equal(out, expected)
    for t, src in zip(static, (q, k, v)):
        t.copy_(src)
    g.replay()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("layout,b,hq,hkv,sq,sk,d,forced", [
    ("bhsd", 3, 12, 12, 2048, 2048, 128, False),  # 4.5 rounds of the 128-CTA grid: the table by the model
    ("bshd", 2, 4, 2, 1000, 1500, 64, True),      # GQA, Sq != Sk, a query tail
    ("bhsd", 1, 6, 6, 1031, 777, 128, True),      # Sk < Sq: tiles past the keys' end
    ("bhsd", 40, 2, 1, 300, 300, 64, True)])      # three tiles a head, fewer heads a group than the grid's
def test_gpu_sm90_causal_tile_order(monkeypatch, layout, b, hq, hkv, sq, sk, d, forced):
    """The causal persistent forward over the host's tile table (``attention_sm90._causal_order``,
    ``PYKERNELS_ATTN_SM90_ORDER``) computes each tile as the alternating rounds do: output and lse bitwise equal
    to the rounds', both against float64; the table made and uploaded where it is taken; a plan first made while
    a CUDA graph captures runs the rounds there and the table after, each replay equal to the eager call."""
    from pykernels._kernels import attention_sm90 as ks
    q, k, v = (t.detach() for t in _sm90_inputs(b, hq, hkv, sq, sk, BF16, layout, d=d))
    scale = d ** -0.5

    def run(mode):
        monkeypatch.setenv("PYKERNELS_ATTN_SM90_ORDER", mode)
        o = ks.attention_fwd_sm90(q, k, v, causal=True, scale=scale)
        return o, ks.forward_plan(q, k, v, causal=True, scale=scale)
    (o_r, l_r), plan_r = run("0")
    assert plan_r.order_spec is None and plan_r.grid[0] % ks._tuning.cdiv(sq, 128) == 0  # the rounds
    (o_t, l_t), plan_t = run("1" if forced else "auto")
    assert plan_t.order_spec is not None and plan_t.order is not None, "this case must take the tile table"
    grid, table = plan_t.order_spec
    assert grid == min(ks._num_sms(q.device), len(table) - grid - 1)
    assert plan_t.order.tolist() == table and plan_t.order.dtype == torch.int32
    assert torch.equal(o_t, o_r) and torch.equal(l_t, l_r)
    kk, vv = (t.repeat_interleave(hq // hkv, 1) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), kk.double(), vv.double(), is_causal=True,
                                                           scale=scale)
    eager = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=scale)
    assert (o_t.double() - ref).abs().max().item() <= 2 * (eager.double() - ref).abs().max().item() + 1e-3
    # a plan first made during a capture: the rounds in that graph, the table once a call runs outside one
    monkeypatch.setenv("PYKERNELS_ATTN_SM90_ORDER", "1")
    ks._FWD_PLANS.clear()
    static = [t.clone() for t in (q, k, v)]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o_g, l_g = ks.attention_fwd_sm90(*static, causal=True, scale=scale)
    plan = ks.forward_plan(*static, causal=True, scale=scale)
    assert plan.order_spec is not None and plan.order is None
    g.replay()
    assert torch.equal(o_g, o_r) and torch.equal(l_g, l_r)
    ks.attention_fwd_sm90(*static, causal=True, scale=scale)  # uploads the table
    assert plan.order is not None
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        o_g2, l_g2 = ks.attention_fwd_sm90(*static, causal=True, scale=scale)
    ks._FWD_PLANS.clear()  # the graph's table outlives the plan (``_ORDER_TABLES``)
    for t in static:
        t.normal_()
    g2.replay()
    assert not torch.equal(o_g2, o_r)
    for t, src in zip(static, (q, k, v)):
        t.copy_(src)
    g2.replay()
    assert torch.equal(o_g2, o_r) and torch.equal(l_g2, l_r)


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("layout,sq,sk,hq,hkv", [("bhsd", 1000, 1100, 4, 2), ("bshd", 1031, 1024, 4, 4),
                                                  ("expanded", 257, 1024, 4, 1), ("bhsd", 64, 1024, 2, 2)])
def test_gpu_sm90_host_descriptors_equal_device_ones(layout, sq, sk, hq, hkv):
    # host-built descriptors over (rows, row stride) views (persistent grid or one tile per CTA) give bit for
    # bit what the per-head descriptors made on the device give
    from pykernels._kernels import attention_sm90 as ks
    b = 2
    if layout == "bshd":
        q, k, v = (torch.randn(b, s, h, 128, dtype=BF16, device="cuda").transpose(1, 2)
                   for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    elif layout == "expanded":  # GQA as expand(): stride 0 over the query heads of a group
        q = torch.randn(b, hq, sq, 128, dtype=BF16, device="cuda")
        k, v = (torch.randn(b, 1, sk, 128, dtype=BF16, device="cuda").expand(b, hq, sk, 128) for _ in range(2))
    else:
        q = torch.randn(b, hq, sq, 128, dtype=BF16, device="cuda")
        k, v = (torch.randn(b, hkv, sk, 128, dtype=BF16, device="cuda") for _ in range(2))
    ql, kl = ks.smem_layouts(64, 128, 128, BF16)
    assert all(ks._flat_descriptor(t, r, lay) is not None for t, r, lay in ((q, 64, ql), (k, 128, kl), (v, 128, kl)))
    for causal in (False, True):
        o_dev, l_dev = ks.attention_fwd_sm90(q, k, v, causal=causal, scale=0.1, host_descriptors=False)
        o_host, l_host = ks.attention_fwd_sm90(q, k, v, causal=causal, scale=0.1)  # persistent unless causal
        assert torch.equal(o_host, o_dev) and torch.equal(l_host, l_dev)
        o_one, l_one = ks.attention_fwd_sm90(q, k, v, causal=causal, scale=0.1, persistent=False)
        assert torch.equal(o_one, o_dev) and torch.equal(l_one, l_dev)
        kk, vv = (t.repeat_interleave(hq // t.shape[1], 1) if t.stride(1) else t for t in (k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), kk.double(), vv.double(),
                                                               is_causal=causal, scale=0.1)
        assert (o_host.double() - ref).abs().max().item() < 2e-2


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("kernels", ["dkdv,dq", "dkdv", "dq", "fused"])
@pytest.mark.parametrize("layout,b,hq,hkv,sq,sk,causal,d", [
    ("bhsd", 2, 4, 2, 1000, 1100, True, 128), ("bshd", 1, 4, 4, 1031, 1024, False, 128),
    ("bhsd", 1, 2, 2, 2049, 1024, True, 128), ("bhsd", 2, 2, 2, 64, 127, False, 128),
    ("bshd", 1, 6, 2, 700, 700, True, 128), ("bhsd", 2, 4, 2, 777, 1000, True, 64), ("bshd", 1, 2, 2, 513, 600, False, 64)])
def test_gpu_sm90_gluon_backward(monkeypatch, kernels, layout, b, hq, hkv, sq, sk, causal, d):
    # each Gluon backward kernel, with the other's Triton kernel (or dK/dV/dQ fused), named by the switch,
    # against float64 and eager's error; a non-contiguous dO (a transposed view); bitwise reproducible
    # where no atomics are involved (all but "fused")
    from pykernels._kernels import attention as katt
    monkeypatch.setenv("PYKERNELS_ATTN_SM90_BWD", kernels)
    ran = _spy_sm90_bwd_kernels(monkeypatch)
    q, k, v = _sm90_inputs(b, hq, hkv, sq, sk, BF16, layout, d)
    do = torch.randn(b, sq, hq, d, dtype=BF16, device="cuda").transpose(1, 2)
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.0, scale=0.1, causal=causal) == kernels
    _, grads = _check_against_ref(q, k, v, causal=causal, scale=0.1, enable_gqa=hq != hkv, do=do,
                                  what=f"sm90 bwd {kernels}")
    expected = [("attention_bwd_dkdv_sm90", True)] if kernels == "fused" else \
        [(f"attention_bwd_{n}_sm90", True) for n in kernels.split(",")]
    assert sorted(ran) == sorted(expected)
    if kernels != "fused":
        out = sdpa(q, k, v, is_causal=causal, scale=0.1, enable_gqa=hq != hkv, backend="triton")
        again = _grads(out, (q, k, v), do)
        assert all(torch.equal(x, y) for x, y in zip(grads, again))


def _near_the_triton_pair(q, k, v, do, causal, grads, ran):
    """With the Gluon backward turned off by the caller: no Gluon kernel runs (``ran``, the spy's list), dQ equals
    ``grads``' (Triton's kernel both times) and dK / dV are within 2% of their largest magnitude (or of 1)."""
    ran.clear()
    out = sdpa(q, k, v, is_causal=causal, scale=0.1, enable_gqa=q.shape[1] != k.shape[1], backend="triton")
    tri = _grads(out, (q, k, v), do)
    assert ran == []
    assert torch.equal(tri[0], grads[0])
    for x, y in zip(tri[1:], grads[1:]):
        assert (x.double() - y.double()).abs().max().item() <= 2e-2 * max(1.0, y.double().abs().max().item())


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("dtype,layout,b,hq,hkv,sq,sk,causal", [
    (BF16, "bhsd", 2, 4, 2, 1000, 1100, True), (BF16, "bshd", 1, 4, 4, 1031, 1024, False),
    (BF16, "bhsd", 2, 2, 2, 64, 127, False), (F16, "bshd", 1, 6, 2, 700, 700, True),
    (BF16, "bhsd", 1, 2, 1, 300, 4096, False), (BF16, "bhsd", 3, 2, 1, 1, 300, False)])
def test_gpu_sm90_gluon_backward_d256(monkeypatch, dtype, layout, b, hq, hkv, sq, sk, causal):
    # D = 256: its dK/dV kernel (``attention_sm90_bwd.DKDV_D256_CONFIGS``: one consumer warpgroup holds dV, the other
    # dK) beside Triton's dQ kernel, which forms delta, where its rule takes it (``DKDV_D256_AUTO``, on by default)
    # and where "dkdv" is named; "dq", "fused" and dropout take nothing there. Against float64 and
    # eager's error (GQA, causal with Sq != Sk, query and key tails (device-made K / V descriptors), Sk a multiple of
    # its 64 keys (host ones), fp16; one query row, where the kernel declines its 64-row Q tile and Triton's dK/dV
    # kernel runs), a non-contiguous dO; bitwise reproducible; close to the Triton kernels' gradients
    from pykernels._kernels import attention as katt
    from pykernels._kernels import attention_sm90_bwd as kb
    monkeypatch.setattr(kb, "DKDV_D256_AUTO", True)
    ran = _spy_sm90_bwd_kernels(monkeypatch)
    q, k, v = _sm90_inputs(b, hq, hkv, sq, sk, dtype, layout, 256)
    do = torch.randn(b, sq, hq, 256, dtype=dtype, device="cuda").transpose(1, 2)
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.0, scale=0.1, causal=causal) == "dkdv"
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.1, scale=0.1, causal=causal) == ""
    _, grads = _check_against_ref(q, k, v, causal=causal, scale=0.1, enable_gqa=hq != hkv, do=do,
                                  what=f"sm90 bwd d256 {layout}")
    assert ran == [("attention_bwd_dkdv_sm90", sq >= 64)], ran
    out = sdpa(q, k, v, is_causal=causal, scale=0.1, enable_gqa=hq != hkv, backend="triton")
    assert all(torch.equal(x, y) for x, y in zip(grads, _grads(out, (q, k, v), do)))  # bitwise reproducible
    for named, want in (("dkdv", "dkdv"), ("dkdv,dq", "dkdv"), ("dq", ""), ("fused", ""), ("", "")):
        monkeypatch.setenv("PYKERNELS_ATTN_SM90_BWD", named)
        assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.0, scale=0.1, causal=causal) == want, named
    _near_the_triton_pair(q, k, v, do, causal, grads, ran)


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("dtype,layout,b,hq,hkv,sq,sk,causal", [
    (BF16, "bhsd", 2, 4, 2, 1000, 1100, True), (BF16, "bhsd", 1, 4, 4, 1024, 1024, False),
    (F16, "bhsd", 1, 6, 2, 700, 700, True), (BF16, "bhsd", 2, 2, 2, 64, 128, False),
    (BF16, "kv_bshd", 2, 4, 2, 300, 512, False), (BF16, "bshd", 1, 4, 4, 512, 512, True)])
@pytest.mark.parametrize("split", [False, True])
def test_gpu_sm90_gluon_backward_d192(monkeypatch, split, dtype, layout, b, hq, hkv, sq, sk, causal):
    # D = 192 (``attention_sm90_bwd.DKDV_D192_AUTO``, default): the D = 256 dK/dV kernel on 192-column descriptors
    # (TMA reads zeros in the tiles' columns 192-255, stores clip there) beside Triton's dQ kernel. Against float64
    # and eager's error: GQA, causal with Sq != Sk and key tails (device-made K / V descriptors), Sk a multiple of 64
    # (host ones), fp16; K / V in the (B, S, H, D) views (device-made descriptors over them); q in those views, where
    # the kernel declines (its slices do not start at column 0) and Triton's dK/dV kernel runs. Bitwise reproducible;
    # close to the Triton kernels' gradients; poisoned outputs (the suite's PYKERNELS_POISON). ``split``: its GEMMs
    # on the columns' 128 + 64 blocks only (``SPLIT_D_BWD``, the default), also close to the padded GEMMs' dK / dV
    from pykernels._kernels import attention as katt
    from pykernels._kernels import attention_sm90 as ks
    from pykernels._kernels import attention_sm90_bwd as kb
    monkeypatch.delenv("PYKERNELS_ATTN_SM90_BWD", raising=False)
    monkeypatch.setattr(kb, "DKDV_D192_AUTO", True)
    monkeypatch.setattr(kb, "SPLIT_D_BWD", split)
    ran = _spy_sm90_bwd_kernels(monkeypatch)
    q, k, v = _sm90_inputs(b, hq, hkv, sq, sk, dtype, layout, 192)
    do = torch.randn(b, hq, sq, 192, dtype=dtype, device="cuda")
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.0, scale=0.1, causal=causal) == "dkdv"
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.1, scale=0.1, causal=causal) == ""
    assert ks.unsupported(q, k, v, None, dropout_p=0.0, scale=0.1, varlen=False) is None
    _, grads = _check_against_ref(q, k, v, causal=causal, scale=0.1, enable_gqa=hq != hkv, do=do,
                                  what=f"sm90 bwd d192 {layout}")
    assert ran == [("attention_bwd_dkdv_sm90", layout != "bshd" and sq >= 64)], ran
    out = sdpa(q, k, v, is_causal=causal, scale=0.1, enable_gqa=hq != hkv, backend="triton")
    assert all(torch.equal(x, y) for x, y in zip(grads, _grads(out, (q, k, v), do)))  # bitwise reproducible
    if split:  # the same k-steps in the same order as the padded GEMMs (their extra ones add zeros)
        monkeypatch.setattr(kb, "SPLIT_D_BWD", False)
        padded = _grads(sdpa(q, k, v, is_causal=causal, scale=0.1, enable_gqa=hq != hkv, backend="triton"), (q, k, v),
                        do)
        for name, x, y in zip("qkv", grads, padded):  # (within an ulp of the largest magnitude)
            scale_max = max(1.0, y.double().abs().max().item())
            assert (x.double() - y.double()).abs().max().item() <= 1e-2 * scale_max, name
    monkeypatch.setattr(kb, "DKDV_D192_AUTO", False)
    _near_the_triton_pair(q, k, v, do, causal, grads, ran)


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("d", [96, 80])
@pytest.mark.parametrize("dtype,layout,b,hq,hkv,sq,sk,causal,named", [
    (BF16, "bhsd", 2, 16, 16, 2048, 2048, False, None),   # the default rule: fused (host K / V descriptors)
    (BF16, "bhsd", 1, 4, 2, 1000, 1500, True, "fused"),   # GQA, causal Sq != Sk, key tails (device-made K / V)
    (F16, "bhsd", 1, 2, 2, 127, 1031, False, "dkdv"),     # beside Triton's dQ kernel; fp16
    (BF16, "kv_bshd", 2, 4, 2, 300, 512, False, "fused"),  # K / V in the (B, S, H, D) views: device-made
    (BF16, "bshd", 2, 4, 2, 512, 512, True, "fused"),     # q there: the forward's CTAs make their descriptors, the
    (BF16, "bhsd", 2, 2, 2, 1, 2048, True, "fused"),      # backward declines (Triton); Sq = 1: declined too
])
def test_gpu_sm90_zero_fill_d80_d96(monkeypatch, d, dtype, layout, b, hq, hkv, sq, sk, causal, named):
    # D = 80 and 96 on the D = 128 Gluon kernels' tiles (``attention_sm90.D80_96``, default; ``TILE_D``): TMA reads
    # zeros past column D and the stores clip there. The forward (host descriptors for (B, H, S, D) rows, else the
    # CTAs' own) and the backward's fused or dK/dV kernel (q and dO (B, H, S, D) rows; K / V any layout) against float64
    # and eager's error; auto then leaves the C++ op (``pykernels.attention._auto_cuda_head_dim_kind``) unmasked only
    import pykernels.attention as pa
    from pykernels._kernels import attention as katt
    from pykernels._kernels import attention_sm90 as a9
    monkeypatch.setattr(a9, "D80_96", True)
    if named is None:
        monkeypatch.delenv("PYKERNELS_ATTN_SM90_BWD", raising=False)
    else:
        monkeypatch.setenv("PYKERNELS_ATTN_SM90_BWD", named)
    ran = _spy_sm90_bwd_kernels(monkeypatch)
    q, k, v = _sm90_inputs(b, hq, hkv, sq, sk, dtype, layout, d)
    do = torch.randn(b, hq, sq, d, dtype=dtype, device="cuda")
    scale = d ** -0.5
    assert katt.sm90_forward(q, k, v, None, dropout_p=0.0, scale=scale, causal=causal)
    plan = a9.forward_plan(q, k, v, causal=causal, scale=scale)
    assert plan.kwargs["HEAD_D"] == 128 and plan.kwargs["D_COLS"] == d
    assert (plan.geo is not None) == (layout == "bhsd" and sq >= 64), plan.geo  # (K / V views: the CTAs' own)
    which = "fused" if named in (None, "fused") else "dkdv"
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.0, scale=scale, causal=causal) == which
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.1, scale=scale, causal=causal) == ""
    # deterministic: "dkdv,dq" from the rule (or "fused" named), the dK/dV kernel alone here (no Gluon dQ at 80 / 96)
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.0, scale=scale, causal=causal, deterministic=True) \
        == "dkdv"
    _check_against_ref(q, k, v, causal=causal, scale=scale, enable_gqa=hq != hkv, do=do, what=f"sm90 d{d} {layout}")
    assert ran == [("attention_bwd_dkdv_sm90", layout != "bshd" and sq >= 64)], ran
    if named is None:  # auto: the Triton path (these kernels) unmasked, the C++ op with key padding
        assert not pa._auto_cuda_head_dim_kind(q, k, v, None)
        keys = torch.ones(b, 1, 1, sk, dtype=torch.bool, device="cuda").expand(b, hq, sq, sk)
        assert pa._auto_cuda_head_dim_kind(q, k, v, keys) == pa._hopper_cpp_kernels(q, k, v, keys)
        monkeypatch.setattr(a9, "D80_96", False)
        assert not katt.sm90_forward(q, k, v, None, dropout_p=0.0, scale=scale, causal=causal)
        assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.0, scale=scale, causal=causal) == ""


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("layout,b,hq,hkv,sq,sk,causal,d", [
    ("bhsd", 2, 4, 4, 1000, 1024, True, 128), ("bshd", 1, 4, 2, 1031, 1024, False, 128),
    ("bshd", 2, 2, 2, 384, 512, True, 64), ("bhsd", 1, 4, 2, 700, 256, False, 64),
    ("expanded", 2, 4, 4, 300, 512, False, 128)])
def test_gpu_sm90_backward_host_kv_descriptors(monkeypatch, fused, layout, b, hq, hkv, sq, sk, causal, d):
    # the dK/dV kernel's K, V, dK and dV through host descriptors over (rows, row stride) views (HOST_KV, Sk a
    # multiple of 128; transposed views at a column offset; K / V expanded over the heads, stride 0) give dK / dV
    # bit for bit what the descriptors made on the device give, and the fused kernel's dQ within its reductions'
    # rounding; poisoned outputs
    from pykernels._kernels import attention as tri
    from pykernels._kernels import attention_sm90_bwd as kb
    took = []

    def spy(*a, _f=kb.host_kv_descriptors, **kw):
        got = _f(*a, **kw)
        took.append(got is not None)
        return got
    monkeypatch.setattr(kb, "host_kv_descriptors", spy)
    if layout == "expanded":  # one K / V head seen as hkv (stride 0); dK / dV per head, as autograd wants them
        q = torch.randn(b, hq, sq, d, dtype=BF16, device="cuda")
        k, v = (torch.randn(b, 1, sk, d, dtype=BF16, device="cuda").expand(b, hkv, sk, d) for _ in range(2))
    else:
        q, k, v = (t.detach() for t in _sm90_inputs(b, hq, hkv, sq, sk, BF16, layout, d))
    do = torch.randn(b, sq, hq, d, dtype=BF16, device="cuda").transpose(1, 2)
    o, lse = tri.attention_fwd(q, k, v, None, causal=causal, scale=0.1, dropout_p=0.0, seed=0)
    delta = (o.float() * do.float()).sum(-1).contiguous()
    res = {}
    for host in (False, True):
        monkeypatch.setattr(kb, "HOST_KV", host)
        dk, dv, dq = (torch.full(t.shape, float("nan"), dtype=BF16, device="cuda") if t.stride(1) == 0
                      else torch.full_like(t, float("nan")) for t in (k, v, q))
        assert kb.attention_bwd_dkdv_sm90(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=0.1,
                                          dq=dq if fused else None)
        res[host] = dk, dv, dq
    assert took == [False, True]
    assert torch.equal(res[True][0], res[False][0]) and torch.equal(res[True][1], res[False][1])
    assert not any(t.isnan().any() for t in res[True][:2])
    if fused:
        torch.testing.assert_close(res[True][2].float(), res[False][2].float(), rtol=2e-2, atol=2e-3)
    g = hq // hkv
    qq, kk, vv, oo = (t.double().requires_grad_() for t in (q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                                              do))
    ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=0.1)
    rdq, rdk, rdv = torch.autograd.grad(ref, (qq, kk, vv), oo)
    rdk, rdv = (t.unflatten(1, (hkv, g)).sum(2) for t in (rdk, rdv))
    for got, want in zip(res[True][:2] + ((res[True][2],) if fused else ()), (rdk, rdv, rdq)):
        assert (got.double() - want).abs().max().item() <= 2e-2 * want.abs().max().item() + 1e-3


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("kernels", ["fused", "dkdv,dq"])
@pytest.mark.parametrize("carry,rot,dtype", [(False, False, BF16), (True, False, BF16), (True, True, BF16),
                                             (True, False, F16)])
@pytest.mark.parametrize("p", [0.1, 0.3])
@pytest.mark.parametrize("layout,b,hq,hkv,sq,sk,causal", [
    ("bhsd", 2, 4, 2, 1000, 1100, True), ("bshd", 1, 4, 4, 1031, 1024, False), ("bhsd", 2, 2, 2, 64, 127, False),
    ("bshd", 1, 6, 2, 700, 700, True), ("bhsd", 1, 2, 1, 1, 17, False)])
def test_gpu_sm90_gluon_backward_dropout(monkeypatch, kernels, carry, rot, dtype, p, layout, b, hq, hkv, sq, sk,
                                         causal):
    # the Gluon dK/dV kernel drawing the forward's dropout mask itself (HAS_DROPOUT; fused with dQ, or beside
    # Triton's dQ kernel: "dkdv,dq" becomes "dkdv" with dropout), odd lengths, GQA, a transposed layout: output
    # and the three gradients against float64 and eager's error with attention_dropout_mask of the seed drawn;
    # a different seed gives different gradients (the mask is drawn, not ignored); keep bits by compares or by the
    # carry chain (DROPOUT_CARRY), its octet transposes by selects or by rotates (DROPOUT_ROT); fp16 too, whose P^T Z
    # (from which dP^T's zeros are read, _apply_keep16) underflows sooner than bf16's
    from pykernels._kernels import attention as katt
    from pykernels._kernels import attention_sm90_bwd as kb
    monkeypatch.setenv("PYKERNELS_ATTN_SM90_BWD", kernels)
    monkeypatch.setattr(kb, "DROPOUT_CARRY", carry)
    monkeypatch.setattr(kb, "DROPOUT_ROT", rot)
    ran = []

    def spy(*a, _f=kb.attention_bwd_dkdv_sm90, **kw):
        took = _f(*a, **kw)
        ran.append((kw.get("dropout_p", 0.0), kw.get("dq") is not None, took))
        return took
    monkeypatch.setattr(kb, "attention_bwd_dkdv_sm90", spy)
    q, k, v = _sm90_inputs(b, hq, hkv, sq, sk, dtype, layout)
    do = torch.randn(b, sq, hq, 128, dtype=dtype, device="cuda").transpose(1, 2)
    want = "fused" if kernels == "fused" else "dkdv"
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=p, scale=0.1, causal=causal) == want
    torch.manual_seed(2024)
    seed = new_seed(q.device)
    torch.manual_seed(2024)
    out = sdpa(q, k, v, dropout_p=p, is_causal=causal, scale=0.1, enable_gqa=hq != hkv, backend="triton")
    dmask = attention_dropout_mask(seed, b, hq, sq, sk, p, "cuda")
    _, grads = _check_against_ref(q, k, v, causal=causal, scale=0.1, enable_gqa=hq != hkv, dropout_p=p,
                                  dropout_mask=dmask, out=out, do=do, what=f"sm90 bwd dropout {kernels} p={p}")
    # (one query row: q and dO have no flat descriptor, so the kernel declines and the Triton kernels run)
    assert ran == [(p, kernels == "fused", sq > 1)]
    torch.manual_seed(7)
    other = _grads(sdpa(q, k, v, dropout_p=p, is_causal=causal, scale=0.1, enable_gqa=hq != hkv,
                        backend="triton"), (q, k, v), do)
    assert not torch.equal(other[1], grads[1])


@pytest.mark.gpu
@sm90_only
@needs_cuda_ext
@pytest.mark.parametrize("b,h,s,causal", [(2, 16, 1024, False), (2, 16, 2048, True), (1, 16, 4096, True)])
def test_gpu_auto_dropout_cpp_forward_gluon_backward(monkeypatch, b, h, s, causal):
    # auto with dropout at D = 128 where the Gluon backward takes it (AUTO_SM90_DROPOUT): the C++ forward kernel
    # (its dropout) and the Gluon dK/dV kernel with the seed that forward drew, through the lane and the full path:
    # against the reference with attention_dropout_mask of that seed; =0 keeps the C++ op (the same mask)
    import pykernels.attention as pa
    from pykernels._kernels import attention_sm90_bwd as kb
    ran = []

    def spy(*a, _f=kb.attention_bwd_dkdv_sm90, **kw):
        took = _f(*a, **kw)
        ran.append((kw.get("dropout_p", 0.0) > 0, took))
        return took
    monkeypatch.setattr(kb, "attention_bwd_dkdv_sm90", spy)
    monkeypatch.delenv("PYKERNELS_ATTN_SM90_BWD", raising=False)
    q, k, v = _sm90_inputs(b, h, h, s, s, BF16, "bshd")
    do = torch.randn(b, s, h, 128, dtype=BF16, device="cuda").transpose(1, 2)
    assert pa._auto_sm90_dropout_kind(q, k, v, None, causal, "auto")
    few = torch.empty(1, 2, 256, 128, dtype=BF16, device="cuda")  # (4 CTAs: the Gluon backward's rule declines)
    assert not pa._auto_sm90_dropout_kind(few, few, few, None, causal, "auto")
    assert not pa._auto_sm90_dropout_kind(q, k, v, None, causal, "cuda")
    assert not pa._auto_sm90_dropout_kind(q, k, v, torch.ones(s, s, dtype=torch.bool, device="cuda"), causal, "auto")
    results = []
    for lane in (True, False):
        monkeypatch.setattr(pa, "_LANE_ON", lane)
        ran.clear()
        torch.manual_seed(99)
        seed = new_seed(q.device)
        torch.manual_seed(99)
        out = sdpa(q, k, v, dropout_p=0.1, is_causal=causal)
        dmask = attention_dropout_mask(seed, b, h, s, s, 0.1, "cuda")
        results.append(_check_against_ref(q, k, v, causal=causal, dropout_p=0.1, dropout_mask=dmask, out=out, do=do,
                                          what=f"auto dropout lane {lane}"))
        assert ran == [(True, True)], (lane, ran)
    assert torch.equal(results[0][0], results[1][0])  # (the same C++ forward either way)
    monkeypatch.setattr(pa, "AUTO_SM90_DROPOUT", False)
    pa._LANE_CUDA.clear()
    ran.clear()
    torch.manual_seed(99)
    out = sdpa(q, k, v, dropout_p=0.1, is_causal=causal)
    assert ran == []
    torch.testing.assert_close(out, results[0][0], atol=0, rtol=0)  # (the C++ forward: the same kernel and mask)


def _spy_gluon_dkdv(monkeypatch) -> list[bool]:
    """The default Gluon backward rule (PYKERNELS_ATTN_SM90_BWD unset), and a list that records each call of its
    dK/dV launcher: True for the fused kernel (given a dQ buffer), False for the pair's dK/dV kernel."""
    from pykernels._kernels import attention_sm90_bwd as kb
    monkeypatch.delenv("PYKERNELS_ATTN_SM90_BWD", raising=False)
    fused = []

    def spy(*a, _f=kb.attention_bwd_dkdv_sm90, **kw):
        fused.append(kw.get("dq") is not None)
        return _f(*a, **kw)
    monkeypatch.setattr(kb, "attention_bwd_dkdv_sm90", spy)
    return fused


@pytest.mark.gpu
@sm90_only
def test_gpu_sm90_default_backward_is_fused_unless_deterministic(monkeypatch):
    # enough full-attention work at D = 128 (256 CTAs of 128 keys): the auto backward is the fused kernel
    # (dQ by TMA reductions), checked against float64; deterministic=True takes the pair, bitwise reproducible
    fused = _spy_gluon_dkdv(monkeypatch)
    q, k, v = _sm90_inputs(2, 8, 8, 2048, 2048, BF16, "bshd")
    do = torch.randn_like(q)
    _check_against_ref(q, k, v, scale=0.1, do=do, what="default sm90 backward")
    assert fused == [True]
    runs = []
    for _ in range(2):
        out = sdpa(q, k, v, scale=0.1, backend="triton", deterministic=True)
        runs.append(_grads(out, (q, k, v), do))
    assert fused == [True, False, False]
    assert all(torch.equal(x, y) for x, y in zip(*runs))
    # the dQ of the fused kernel matches the pair's to fp32 summation order
    out = sdpa(q, k, v, scale=0.1, backend="triton")
    dq = _grads(out, (q, k, v), do)[0]
    assert (dq.float() - runs[0][0].float()).abs().max().item() <= 2e-2 * runs[0][0].float().abs().max().item()


@pytest.mark.gpu
@sm90_only
def test_gpu_sm90_default_causal_backward_is_fused_from_threshold(monkeypatch):
    # causal MHA at D = 128 from FUSED_CAUSAL_MIN_SK keys (2048 since H200 run440, 1.05x the pair at 8 x 16 x 2048
    # in graph replay): the auto backward is the fused kernel, checked against float64; below the threshold, and
    # with GQA, the pair
    from pykernels._kernels import attention_sm90_bwd as kb
    fused = _spy_gluon_dkdv(monkeypatch)
    n = kb.FUSED_CAUSAL_MIN_SK
    q, k, v = _sm90_inputs(2, 8, 8, n, n, BF16, "bshd")  # 2 * 8 * n / 128 CTAs of 128 keys
    _check_against_ref(q, k, v, causal=True, scale=0.1, do=torch.randn_like(q), what="causal fused")
    assert fused == [True]
    q, k, v = _sm90_inputs(4, 8, 8, n // 2, n // 2, BF16, "bshd")
    _check_against_ref(q, k, v, causal=True, scale=0.1, do=torch.randn_like(q), what="causal pair")
    assert fused == [True, False]
    q, k, v = _sm90_inputs(4, 8, 4, n, n, BF16, "bshd")  # GQA (4 * 4 * n / 128 CTAs)
    _check_against_ref(q, k, v, causal=True, scale=0.1, enable_gqa=True, do=torch.randn_like(q), what="causal GQA")
    assert fused == [True, False, False]


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("kernels", ["dkdv,dq", "fused"])
def test_gpu_sm90_causal_head_groups_change_only_the_order(monkeypatch, kernels):
    # the causal longest-first order in groups of heads (LPT_L2_BYTES): groups of 1 head, of 3 (7 heads in 2
    # batches: a short last group) and all heads at once give the same gradients (the pair: bitwise; each
    # CTA's work is the same) and match float64
    from pykernels._kernels import attention_sm90_bwd as kb
    monkeypatch.setenv("PYKERNELS_ATTN_SM90_BWD", kernels)
    monkeypatch.setattr(kb, "LPT_MIN_WAVES", 0)  # (these few CTAs would otherwise make one group)
    q, k, v = _sm90_inputs(2, 7, 7, 1000, 1000, BF16, "bhsd")
    do = torch.randn_like(q)
    head = 2 * 1000 * 128 * 2  # a head's Q and dO (the dK/dV kernel), its K and V (the dQ kernel)
    grads = []
    for budget, heads in ((0, 14), (head, 1), (3 * head, 3)):
        monkeypatch.setattr(kb, "LPT_L2_BYTES", budget)
        assert kb.lpt_group(14, head, 4, q.device) == heads
        out = sdpa(q, k, v, is_causal=True, scale=0.1, backend="triton")
        grads.append(_grads(out, (q, k, v), do))
    assert kb.lpt_group(14, head, 4, q.device, grouped=False) == 14  # GQA: all heads at once
    monkeypatch.setattr(kb, "LPT_MIN_WAVES", 1)  # at least one CTA per SM: groups of >= 132 / 4 = 33 CTAs
    assert kb.lpt_group(14, head, 4, q.device) == 14
    for other in grads[1:]:
        for x, y in zip(grads[0], other):
            assert torch.equal(x, y) if kernels == "dkdv,dq" else (x.float() - y.float()).abs().max().item() < 1e-2
    _check_against_ref(q, k, v, causal=True, scale=0.1, do=do, what=f"head groups {kernels}")


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_sm90_causal_grid_runs_lpt_order(monkeypatch, fused):
    # the causal dK/dV grid's CTAs take (rank, head) as the host's copy of the order says (``lpt_order``, read back
    # from the development timeline's slot 7), with the last LPT_TAIL_GROUPS head groups merged (1: the order before
    # run437), each CTA's query blocks as its rank gives them (slot 6); dK and dV are the same bits in every order
    from pykernels._kernels import attention_sm90_bwd as kb
    from pykernels._kernels import attention as tri
    monkeypatch.setattr(kb, "LPT_MIN_WAVES", 0)
    b, h, s, d = 2, 7, 1000, 128
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=BF16) for _ in range(4))
    o, lse = tri.attention_fwd(q, k, v, None, causal=True, scale=0.1, dropout_p=0.0, seed=0)
    delta = (o.float() * do.float()).sum(-1).contiguous()
    head = 2 * s * d * 2
    n_kb, n_qb = -(-s // 128), -(-s // 64)
    first = None
    for budget, merged in ((head, 1), (head, 2), (head, 5), (3 * head, 2), (0, 2)):
        monkeypatch.setattr(kb, "LPT_L2_BYTES", budget)
        monkeypatch.setattr(kb, "LPT_TAIL_GROUPS", merged)
        g = kb.lpt_group(b * h, head, n_kb, q.device)
        tail_from = kb.lpt_tail_from(b * h, g)
        trace = torch.full((b * h * n_kb, int(kb.TRACE_SLOTS)), -1, dtype=torch.int64, device="cuda")
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        dq = torch.full_like(q, float("nan")) if fused else None
        assert kb.attention_bwd_dkdv_sm90(do, q, k, v, lse, delta, dk, dv, causal=True, scale=0.1, dq=dq, trace=trace)
        t = trace.cpu()
        order = [(int(x) & 0xFFFF, int(x) >> 16) for x in t[:, 7]]
        assert order == kb.lpt_order(n_kb, b * h, g, tail_from), (budget, merged)
        assert t[:, 6].tolist() == [n_qb - min(n_qb, 2 * r) for r, _ in order]
        marks = t[:, [0, 8, 9, 1, 10, 11, 2, 3, 12, 4]]  # every mark set, none before the CTA's entry
        assert (marks > 0).all() and (marks >= t[:, :1]).all() and (t[:, 4] >= t[:, 3]).all()
        if first is None:
            first = (dk.clone(), dv.clone())
        assert torch.equal(dk, first[0]) and torch.equal(dv, first[1]), (budget, merged)
        if fused:
            got_dq = dq.clone()
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    mask = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
    p64 = torch.softmax((q64 @ k64.transpose(-1, -2) * 0.1).masked_fill(~mask, float("-inf")), dim=-1)
    ref = torch.autograd.grad(p64 @ v64, (q64, k64, v64), do.double())
    for got, want in zip(((got_dq if fused else None), first[0], first[1]), ref):
        if got is not None:
            assert (got.double() - want).abs().max().item() <= 2e-2 * want.abs().max().item()


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("kernels", ["dkdv,dq", "fused"])
def test_gpu_sm90_backward_declined_layouts_run_triton(monkeypatch, kernels):
    # a Gluon backward kernel that declines the case (17 queries: no 64-row Q tile through a host
    # descriptor) leaves it to its Triton kernel, every gradient still computed (the suite NaN-poisons
    # every output: a gradient no kernel wrote fails the comparison)
    monkeypatch.setenv("PYKERNELS_ATTN_SM90_BWD", kernels)
    from pykernels._kernels import attention as katt
    q, k, v = _sm90_inputs(2, 4, 2, 17, 1024, BF16, "bhsd")
    do = torch.randn_like(q)
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.0, scale=0.1, causal=True) == kernels
    _check_against_ref(q, k, v, causal=True, scale=0.1, enable_gqa=True, do=do, what=f"declined {kernels}")


@pytest.mark.gpu
@sm90_only
def test_gpu_sm90_backward_dispatch_rules(monkeypatch):
    from pykernels._kernels import attention as katt
    from pykernels._kernels import attention_sm90_bwd as kb
    q, k, v = _sm90_inputs(8, 2, 2, 256, 2048, BF16, "bhsd")  # 8 * 2 * 16 CTAs of 128 keys
    do = torch.randn_like(q)
    assert kb.FUSED_MIN_SK <= 1024 and kb.FUSED_CAUSAL_MIN_SK == 2048
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.0, scale=0.1) == "fused"
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.0, scale=0.1, deterministic=True) == "dkdv,dq"
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.0, scale=0.1, causal=True) == "fused"
    q2, k2, v2 = _sm90_inputs(16, 2, 2, 256, 1024, BF16, "bhsd")  # 16 * 2 * 8 CTAs
    do2 = torch.randn_like(q2)
    assert katt.sm90_backward(q2, k2, v2, do2, None, dropout_p=0.0, scale=0.1, causal=True) == "dkdv,dq"
    assert katt.sm90_backward(q2, k2, v2, do2, None, dropout_p=0.0, scale=0.1) == "fused"
    q3, k3, v3 = _sm90_inputs(32, 2, 2, 256, 512, BF16, "bhsd")  # 32 * 2 * 4 CTAs, below FUSED_MIN_SK
    assert katt.sm90_backward(q3, k3, v3, torch.randn_like(q3), None, dropout_p=0.0, scale=0.1) == "dkdv,dq"
    assert katt.sm90_backward(q[:1], k[:1], v[:1], do[:1], None, dropout_p=0.0, scale=0.1) == ""  # 32 CTAs
    assert katt.sm90_backward(q[..., :64], k[..., :64], v[..., :64], do[..., :64], None, dropout_p=0.0,
                              scale=0.1) == ""  # D = 64: the Triton kernels
    # with dropout the dK/dV kernel draws the mask: fused, or beside Triton's dQ kernel ("dkdv,dq" -> "dkdv", "dq" ->
    # ""), and nothing where DROPOUT_KERNELS is off
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.1, scale=0.1) == "fused"
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.1, scale=0.1, deterministic=True) == "dkdv"
    assert katt.sm90_backward(q3, k3, v3, torch.randn_like(q3), None, dropout_p=0.1, scale=0.1) == "dkdv"
    monkeypatch.setenv("PYKERNELS_ATTN_SM90_BWD", "dq")
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.1, scale=0.1) == ""
    monkeypatch.delenv("PYKERNELS_ATTN_SM90_BWD")
    monkeypatch.setattr(kb, "DROPOUT_KERNELS", False)
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.1, scale=0.1) == ""
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.0, scale=0.1) == "fused"
    assert katt.sm90_backward(q, k, v, do.expand_as(q)[..., :1].expand_as(q), None, dropout_p=0.0, scale=0.1) == ""
    assert katt.sm90_backward(q, k, v, do.float(), None, dropout_p=0.0, scale=0.1) == ""
    monkeypatch.setenv("PYKERNELS_ATTN_SM90_BWD", "")
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.0, scale=0.1) == ""
    monkeypatch.setenv("PYKERNELS_ATTN_SM90_BWD", "dq")
    monkeypatch.setenv("PYKERNELS_ATTN_SM90", "0")
    assert katt.sm90_backward(q, k, v, do, None, dropout_p=0.0, scale=0.1) == ""


# The sm_90 forward's host side runs anywhere: its descriptor views and its dispatch rule (CPU tests)
def test_sm90_flat_descriptors_views():
    from pykernels._kernels import attention_sm90 as ks
    ql, kl = ks.smem_layouts(64, 128, 64, BF16)
    b, h, s, d = 2, 3, 256, 64
    t = torch.randn(b, h, s, d, dtype=BF16)
    desc = ks._flat_descriptor(t, 64, ql)  # contiguous: rows (b, h, s), one column block
    assert (desc.shape, desc.strides, desc.block_shape) == ([b * h * s, d], [d, 1], [64, d])
    t = torch.randn(b, s, h, d, dtype=BF16).transpose(1, 2)  # transformers' layout: heads side by side in a row
    desc = ks._flat_descriptor(t, 64, ql)
    assert (desc.shape, desc.strides) == ([b * s, h * d], [h * d, 1])
    t = torch.randn(b, 1, s, d, dtype=BF16).expand(b, h, s, d)  # expanded heads (GQA by expand)
    assert ks._flat_descriptor(t, 128, kl).shape == [b * s, d]
    t = torch.randn(b, h, s, 80, dtype=BF16)[..., :d]  # padded rows: the row stride is not D
    assert ks._flat_descriptor(t, 64, ql).shape == [b * h * s, 80]
    # no (rows, row stride) view: a batch stride that is not a whole number of rows; too few rows for a tile
    base = torch.randn(2 * (h * s * d + 8), dtype=BF16)
    odd = base.as_strided((2, h, s, d), (h * s * d + 8, s * d, d, 1))
    assert ks._flat_descriptor(odd, 64, ql) is None
    assert ks._flat_descriptor(torch.randn(1, 2, 17, d, dtype=BF16), 64, ql) is None


def test_sm90_zero_fill_descriptors_d192():
    # D = 192 on the D = 256 dK/dV kernel's tiles (``attention_sm90_bwd.DKDV_D192_AUTO``): the host
    # descriptors are 192 columns wide with 256-wide tiles (TMA reads zeros past column 192), only where every
    # (batch, head) slice starts at column 0 of the (rows, row stride) view; the host K / V set likewise or none
    from pykernels._kernels import attention_sm90 as ks
    from pykernels._kernels import attention_sm90_bwd as kb
    ql, kl = ks.smem_layouts(64, 64, 256, BF16)
    b, h, s, d = 2, 3, 128, 192
    t = torch.randn(b, h, s, d, dtype=BF16)
    desc = kb._zero_fill_descriptor(t, 64, 256, ql)  # (B, H, S, D) rows: every slice at column 0
    assert (desc.shape, desc.strides, desc.block_shape) == ([b * h * s, d], [d, 1], [64, 256])
    padded = torch.randn(b, h, s, 256, dtype=BF16)[..., :d]  # rows 256 wide: the tile's last 64 columns are the
    desc = kb._zero_fill_descriptor(padded, 64, 256, ql)  # padding, outside the descriptor's 192
    assert (desc.shape, desc.strides) == ([b * h * s, d], [256, 1])
    expanded = torch.randn(b, 1, s, d, dtype=BF16).expand(b, h, s, d)  # GQA by expand: stride 0 over the heads
    assert kb._zero_fill_descriptor(expanded, 64, 256, kl).shape == [b * s, d]
    # transformers' (B, S, H, D) views: head h at column h D of a row, so a 256-wide tile would read head h + 1
    bshd = torch.randn(b, s, h, d, dtype=BF16).transpose(1, 2)
    assert ks._flat_descriptor(bshd, 64, ql) is not None and kb._zero_fill_descriptor(bshd, 64, 256, ql) is None
    assert kb._zero_fill_descriptor(torch.randn(1, 1, 17, d, dtype=BF16), 64, 256, ql) is None  # fewer rows than a tile
    # the forward's plan takes the same geometry (``attention_sm90.TILE_D``): the (B, S, H, D) views of several heads
    # have a flat view, but not one whose heads start at column 0
    assert ks._flat_geometry(bshd.shape, bshd.stride(), 64) == (b * s, h * d)
    assert ks._flat_geometry(bshd.shape, bshd.stride(), 64, zero_fill=True) is None
    assert ks._flat_geometry(t.shape, t.stride(), 64, zero_fill=True) == (b * h * s, d)
    assert ks._descriptor_fields((b * h * s, d), 64, d, ql, 256)[:3] == ([b * h * s, d], [d, 1], [64, 256])
    assert ks._descriptor_fields((b * s, h * d), 64, d, ql)[:3] == ([b * s, h * d], [h * d, 1], [64, d])
    one_head = torch.randn(b, s, 1, d, dtype=BF16).transpose(1, 2)  # one head: its slices start at column 0
    assert kb._zero_fill_descriptor(one_head, 64, 256, ql).shape == [b * s, d]
    k = torch.randn(b, h, s, d, dtype=BF16)
    got = kb.host_kv_descriptors(k, k, k, k, 64, kl, cta_keys=64, tile_d=256)
    assert got is not None and all((x.shape, x.block_shape) == ([b * h * s, d], [64, 256]) for x in got)
    assert kb.host_kv_descriptors(bshd, k, k, k, 64, kl, cta_keys=64, tile_d=256) is None  # made on the device
    assert kb.host_kv_descriptors(k[:, :, :100], k, k, k, 64, kl, cta_keys=64, tile_d=256) is None  # key tail


def test_sm90_backward_d192_rule_on_cpu(monkeypatch):
    # the D = 192 rule: "dkdv" with DKDV_D192_AUTO (default on) or a named "dkdv"; the dK/dV kernel's config is the
    # D = 256 one
    from pykernels._kernels import attention_sm90_bwd as kb
    monkeypatch.delenv("PYKERNELS_ATTN_SM90_BWD", raising=False)
    q = torch.empty(2, 4, 1024, 192, dtype=BF16)
    monkeypatch.setattr(kb, "DKDV_D192_AUTO", False)
    assert kb.kernels(q, q, causal=False, sms=132) == ""
    monkeypatch.setattr(kb, "DKDV_D192_AUTO", True)
    assert kb.kernels(q, q, causal=True, sms=132) == "dkdv"
    assert kb.kernels(q, q, causal=False, sms=132, deterministic=True) == "dkdv"
    monkeypatch.setattr(kb, "DKDV_D192_AUTO", False)
    monkeypatch.setenv("PYKERNELS_ATTN_SM90_BWD", "dkdv")
    assert kb.kernels(q, q, causal=False, sms=132) == "dkdv"
    assert kb.DKDV_D256_CONFIGS[192] == kb.DKDV_D256_CONFIGS[256]


def test_sm90_backward_d80_d96_rule_on_cpu(monkeypatch):
    # D = 80 / 96 (``attention_sm90.D80_96``, default on): the D = 128 rule where on ("fused" from FUSED_MIN_SK keys,
    # "dkdv,dq" with fewer or deterministic, nothing with too few CTAs), nothing where off; a named value either way
    from pykernels._kernels import attention_sm90 as a9
    from pykernels._kernels import attention_sm90_bwd as kb
    monkeypatch.delenv("PYKERNELS_ATTN_SM90_BWD", raising=False)
    for d in (80, 96):
        q = torch.empty(2, 16, 2048, d, dtype=BF16)
        monkeypatch.setattr(a9, "D80_96", False)
        assert not a9.zero_fill_on(d) and kb.kernels(q, q, causal=False, sms=132) == ""
        monkeypatch.setattr(a9, "D80_96", True)
        assert a9.zero_fill_on(d)
        assert kb.kernels(q, q, causal=False, sms=132) == kb.kernels(q[..., :1].expand(2, 16, 2048, 128), q,
                                                                     causal=False, sms=132) == "fused"
        assert kb.kernels(q, q, causal=False, sms=132, deterministic=True) == "dkdv,dq"
        assert kb.kernels(q[:, :, :1000], q[:, :, :1000], causal=False, sms=132) == "dkdv,dq"
        assert kb.kernels(q[:1, :2], q[:1, :2], causal=False, sms=132) == ""  # 32 CTAs of 128 keys
        monkeypatch.setattr(a9, "D80_96", False)
        monkeypatch.setenv("PYKERNELS_ATTN_SM90_BWD", "fused")
        assert kb.kernels(q, q, causal=False, sms=132) == "fused"
        monkeypatch.delenv("PYKERNELS_ATTN_SM90_BWD")
    assert a9.zero_fill_on(192) == a9.D192 and a9.zero_fill_on(128) and a9.zero_fill_on(64)


def _order_makespan(table, grid, n_m, cost):
    """The last CTA's modelled work under ``_causal_order``'s table (``cost[p]``: query tile p's)."""
    starts, tiles = table[:grid + 1], table[grid + 1:]
    return max(sum(cost[t % n_m] for t in tiles[starts[c]:starts[c + 1]]) for c in range(grid))


def test_sm90_backward_lpt_order_on_cpu(monkeypatch):
    """The causal backward grids' order (``attention_sm90_bwd.lpt_order``, the host's copy of ``_lpt_order``):
    every (rank, head) once; the head groups one after the other, each rank by rank (longest first); the last
    LPT_TAIL_GROUPS groups as one, so that the grid's last CTAs are the shortest rank of that merged group's heads;
    with LPT_TAIL_GROUPS 1 the order before run437, written out here."""
    from pykernels._kernels import attention_sm90_bwd as kb

    def before(n_units, n_heads, lpt_heads):  # _lpt_order until run436, per CTA
        out = []
        for pid in range(n_units * n_heads):
            group, r = divmod(pid, lpt_heads * n_units)
            g_size = min(lpt_heads, n_heads - group * lpt_heads)
            rank = r // g_size
            out.append((rank, group * lpt_heads + r - rank * g_size))
        return out

    for n_units, n_heads, lpt_heads in [(32, 64, 6), (64, 32, 3), (16, 128, 12), (8, 14, 3), (8, 14, 1), (8, 14, 14),
                                        (16, 36, 12), (5, 7, 2)]:
        every = sorted((r, h) for r in range(n_units) for h in range(n_heads))
        monkeypatch.setattr(kb, "LPT_TAIL_GROUPS", 1)
        tail_from = kb.lpt_tail_from(n_heads, lpt_heads)
        assert kb.lpt_order(n_units, n_heads, lpt_heads, tail_from) == before(n_units, n_heads, lpt_heads)
        for merged in (2, 3):
            monkeypatch.setattr(kb, "LPT_TAIL_GROUPS", merged)
            n_groups = -(-n_heads // lpt_heads)
            tail_from = kb.lpt_tail_from(n_heads, lpt_heads)
            assert tail_from % lpt_heads == 0 and tail_from == max(0, n_groups - merged) * lpt_heads
            order = kb.lpt_order(n_units, n_heads, lpt_heads, tail_from)
            assert sorted(order) == every
            n_first = tail_from * n_units
            assert order[:n_first] == before(n_units, n_heads, lpt_heads)[:n_first]  # the groups before: unchanged
            last = order[n_first:]
            assert [r for r, _ in last] == sorted(r for r, _ in last)  # the merged group: rank by rank
            assert {h for _, h in last} == set(range(tail_from, n_heads))
            assert all(r == n_units - 1 for r, _ in last[-(n_heads - tail_from):])  # ends on its shortest CTAs


def test_sm90_causal_tile_order_on_cpu(monkeypatch):
    """The causal persistent forward's tile table (``attention_sm90._causal_order``): every tile exactly once,
    the CTAs' runs back to back, a CTA per SM, each (batch, head) group's tiles handed out longest first; taken
    where it is modelled faster than the alternating rounds, never where it is not (unless forced); the switch."""
    from pykernels._kernels import attention_sm90 as ks
    for n_m, n_bh, sk, rows, bn, head_bytes in [(32, 64, 4096, 128, 128, 2 << 20),   # B4 H16 S4096 D128
                                                (64, 32, 8192, 128, 128, 4 << 20),   # B2 H16 S8192 D128
                                                (16, 36, 2048, 128, 128, 1 << 20),   # B3 H12 S2048: 4.5 rounds
                                                (32, 300, 4096, 128, 128, 2 << 20),  # past ORDER_FEW_GROUPS_TILES
                                                (8, 3, 1000, 128, 128, 1 << 20)]:    # fewer tiles than SMs
        forced = ks._causal_order(n_m, n_bh, sk, rows, bn, 132, head_bytes, force=True)
        assert forced is not None
        grid, table = forced
        n_tiles = n_m * n_bh
        assert grid == min(132, n_tiles) and len(table) == grid + 1 + n_tiles
        starts = table[:grid + 1]
        assert starts[0] == 0 and starts[-1] == n_tiles and all(a < b for a, b in zip(starts, starts[1:]))
        assert sorted(table[grid + 1:]) == list(range(n_tiles))
        cost = [ks._tuning.cdiv(min(sk, (p + 1) * rows), bn) + ks.ORDER_TILE_COST for p in range(n_m)]
        total = n_bh * sum(cost)
        span = _order_makespan(table, grid, n_m, cost)
        assert total / grid <= span <= total / grid + max(cost)  # (greedy's bound: one tile past the mean)
        if n_tiles >= 15 * 132:  # many tiles a CTA: within 1% of a perfect split
            assert span <= 1.01 * total / grid, (n_m, n_bh, span, total / grid)
        if n_tiles >= 4 * 132:  # taken unforced: the rounds leave 4 of the 132 SMs idle (or worse)
            assert ks._causal_order(n_m, n_bh, sk, rows, bn, 132, head_bytes) == forced
    # GPT-2's shape (B8 H12 S1024 D64): modelled level with the rounds, so taken (measured 1.027x, run430)
    assert ks._causal_order(8, 96, 1024, 128, 128, 132, 256 << 10) is not None
    # the rounds already balanced (132 SMs = 33 whole heads of 4 tiles): no table unless forced
    assert ks._causal_order(4, 66, 512, 128, 128, 132, 1 << 20) is None
    assert ks._causal_order(4, 66, 512, 128, 128, 132, 1 << 20, force=True) is not None
    # a group's tiles longest first: a CTA's first tile is among the longest of the first group
    grid, table = ks._causal_order(64, 32, 8192, 128, 128, 132, 4 << 20, force=True)
    firsts = [table[grid + 1 + table[c]] % 64 for c in range(grid)]
    assert min(firsts) >= 64 - 132 // 2 - 1
    monkeypatch.setenv("PYKERNELS_ATTN_SM90_ORDER", "sometimes")
    with pytest.raises(ValueError, match="PYKERNELS_ATTN_SM90_ORDER"):
        ks.order_mode()
    for value, mode in (("", "auto"), ("AUTO", "auto"), ("1", "1"), ("0", "0")):
        monkeypatch.setenv("PYKERNELS_ATTN_SM90_ORDER", value)
        assert ks.order_mode() == mode


def test_sm90_dispatch_rule_and_cover_on_cpu(monkeypatch):
    from pykernels._kernels import attention as katt
    from pykernels._kernels import attention_sm90 as ks

    def qk(d, sk):
        return torch.empty(1, 1, 64, d), torch.empty(1, 1, sk, d)
    assert ks.preferred(*qk(128, 17), causal=True) and ks.preferred(*qk(128, 8192), causal=False)
    assert ks.preferred(*qk(64, 512), causal=False) and not ks.preferred(*qk(64, 256), causal=False)
    assert ks.preferred(*qk(64, 1024), causal=True) and not ks.preferred(*qk(64, 512), causal=True)
    assert not ks.preferred(*qk(72, 4096), causal=False)  # (no tiles for it: Triton)
    for d in (80, 96, 192):  # on wider tiles (``TILE_D``) where their switch is on
        assert ks.preferred(*qk(d, 4096), causal=False) == ks.zero_fill_on(d)
    monkeypatch.setattr(ks, "D80_96", False)
    assert not ks.preferred(*qk(80, 4096), causal=False) and ks.preferred(*qk(192, 4096), causal=False) == ks.D192
    monkeypatch.setenv("PYKERNELS_ATTN_SM90", "0")
    assert not ks.preferred(*qk(128, 4096), causal=False)
    q = torch.randn(1, 2, 64, 128, dtype=BF16)
    assert ks.unsupported(q, q, q, None, dropout_p=0.0, scale=0.1, varlen=False) == "not an sm_90 GPU"
    for empty in (q[:0], q[:, :0], q[:, :, :0]):  # no batch, no head, no query: never a grid of no programs
        assert ks.unsupported(empty, q, q, None, dropout_p=0.0, scale=0.1, varlen=False) == "an empty tensor"
    assert ks.unsupported(q, q[:, :, :0], q[:, :, :0], None, dropout_p=0.0, scale=0.1, varlen=False) == "an empty tensor"
    assert not katt.sm90_forward(q, q, q, None, dropout_p=0.0, scale=0.1)  # CPU tensors: never
    assert katt.sm90_backward(q, q, q, q, None, dropout_p=0.0, scale=0.1) == ""
    from pykernels._kernels import attention_sm90_bwd as kb
    k = torch.empty(4, 2, 4096, 128, dtype=BF16)  # 4 * 2 * 32 CTAs of 128 keys
    # full attention: the fused kernel unless deterministic; causal: the pair below FUSED_CAUSAL_MIN_SK keys
    assert kb.kernels(q, k, causal=False, sms=132) == "fused"
    assert kb.kernels(q[..., :64], k, causal=False, sms=132) == ""
    assert kb.kernels(q, k, causal=False, sms=132, deterministic=True) == "dkdv,dq"
    mid_k = torch.empty(16, 2, kb.FUSED_CAUSAL_MIN_SK // 2, 128, dtype=BF16)  # 16 * 2 * 8 CTAs (at 2048 keys)
    assert kb.kernels(q, mid_k, causal=True, sms=132) == "dkdv,dq"
    long_k = torch.empty(8, 2, kb.FUSED_CAUSAL_MIN_SK, 128, dtype=BF16)  # 8 * 2 * 16 CTAs
    assert kb.kernels(q, long_k, causal=True, sms=132) == "fused"
    assert kb.kernels(q, long_k, causal=True, sms=132, deterministic=True) == "dkdv,dq"
    assert kb.kernels(q.repeat(1, 2, 1, 1), long_k, causal=True, sms=132) == "dkdv,dq"  # causal GQA: the pair
    short_k = torch.empty(200, 2, kb.FUSED_MIN_SK // 2, 128, dtype=BF16)
    assert kb.kernels(q, short_k, causal=False, sms=132) == "dkdv,dq"  # full attention below FUSED_MIN_SK keys
    assert kb.kernels(q, k[:, :, :2000], causal=False, sms=132) == ""  # 4 * 2 * 16 CTAs: fewer than the SMs
    q256 = torch.empty(1, 2, 64, 256, dtype=BF16)  # D = 256: its dK/dV kernel where DKDV_D256_AUTO (default)
    monkeypatch.setattr(kb, "DKDV_D256_AUTO", False)
    assert kb.kernels(q256, q256, causal=True, sms=132) == ""
    monkeypatch.setattr(kb, "DKDV_D256_AUTO", True)
    assert kb.kernels(q256, q256, causal=True, sms=132) == "dkdv"
    assert kb.kernels(q256, q256, causal=False, sms=132, deterministic=True) == "dkdv"  # (no atomics in it)
    monkeypatch.setenv("PYKERNELS_ATTN_SM90_BWD", "fused")
    assert kb.kernels(q, k, causal=True, sms=132) == "fused"
    with pytest.raises(ValueError, match="deterministic=True conflicts"):
        sdpa(q, q, q, deterministic=True)
    det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert kb.kernels(q, k, causal=True, sms=132) == "dkdv,dq"  # no atomics in deterministic mode
        monkeypatch.delenv("PYKERNELS_ATTN_SM90_BWD")
        assert kb.kernels(q, k, causal=False, sms=132) == "dkdv,dq"
    finally:
        torch.use_deterministic_algorithms(det)


# ---------------------------------------------------------------------------------------------
# The CUDA C++ backend (csrc/attention.cu, torch.ops.pykernels_cuda.attention): taken only when named
# ---------------------------------------------------------------------------------------------
CUDA_DENSE = [  # b, hq, hkv, sq, sk, d, causal: odd lengths, Sq != Sk both ways, GQA / MQA, head dims 16..256
    (2, 4, 4, 1000, 1000, 64, False),
    (2, 4, 2, 127, 1000, 128, True),
    (1, 3, 1, 1, 17, 80, True),
    (2, 2, 2, 17, 1, 96, False),
    (1, 2, 2, 300, 257, 16, True),
    (1, 4, 2, 129, 130, 256, True),
    (1, 2, 2, 200, 190, 160, False),
    (1, 2, 1, 1000, 777, 40, True),
    (1, 2, 2, 65, 64, 224, False),
    (4, 12, 4, 1000, 1000, 64, True),  # more query tiles than SMs: the persistent forward's blocks take several
    (3, 16, 16, 513, 513, 128, False),
]


@pytest.fixture(params=["default", "wgmma", "mma_sync"])
def cuda_fwd(request, monkeypatch):
    """The C++ forward kernel under test (PYKERNELS_CUDA_ATTN_SM90, read at each launch): the default (on an sm_90a
    build and a compute-capability 9.0 device, the warp-specialised wgmma forward at head dims up to 128), the wgmma
    kernels without warp specialisation ("1") or the mma.sync kernels ("0")."""
    env = {"wgmma": "1", "mma_sync": "0"}.get(request.param)
    _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_SM90", env)
    return request.param


def _set_env(monkeypatch, name: str, value: str | None) -> None:
    """``name`` set to ``value`` for the test, or unset where ``value`` is None."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


def _sm90a_device() -> bool:
    """Whether the C++ extension has sm_90a code and the device is compute capability 9.0 (its wgmma kernels run)."""
    import pykernels._C as ext
    return bool(ext.sm90a) and torch.cuda.get_device_capability() == (9, 0)


def _cuda_fwd_kernels(q, k, v, **kw) -> list[str]:
    """The names of the attention forward kernels one C++ call launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sdpa(q, k, v, backend="cuda", **kw)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "attn_fwd" in e.name]


def _ws_fwd_args(q, k, v, **kw) -> list[list[str]]:
    """The template arguments (T, D, MODE, NW, kOvl, kMix, kRange) of each warp-specialised forward kernel one C++
    call launches."""
    names = [n for n in _cuda_fwd_kernels(q, k, v, **kw) if "attn_fwd_sm90_ws_kernel<" in n]
    assert names, _cuda_fwd_kernels(q, k, v, **kw)
    return [[a.strip() for a in n.split("attn_fwd_sm90_ws_kernel<", 1)[1].split(">", 1)[0].split(",")] for n in names]


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_cuda_forward_kernel_choice(monkeypatch):
    """Which C++ forward runs: when the build has sm_90a code and the device is compute capability 9.0 (H100 / H200:
    the GPU runs take this branch), at head dims up to 128 the warp-specialised wgmma kernel (attn_fwd_sm90_ws_kernel)
    with or without a mask; PYKERNELS_CUDA_ATTN_SM90=1 selects attn_fwd_sm90_kernel (up to 64) /
    attn_fwd_sm90_pipe_kernel (above) instead, as does a scale that is not positive without a mask
    (test_gpu_cuda_backend_scale_sign); else, and above 128, the mma.sync kernel, which PYKERNELS_CUDA_ATTN_SM90=0
    selects too."""
    hopper = _sm90a_device()

    def plain(d):
        return "attn_fwd_sm90_kernel" if d <= 64 else "attn_fwd_sm90_pipe"

    for env in (None, "1"):
        _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_SM90", env)
        for d in (16, 64, 80, 128, 160):
            q, k, v = _inputs((2, 2, 100, d), (2, 2, 100, d), (2, 2, 100, d), BF16, "cuda", requires_grad=False)
            pad = torch.ones(2, 1, 1, 100, dtype=torch.bool, device="cuda")
            pad[1, ..., 60:] = False
            for mask, causal in ((None, True), (pad, False), (torch.rand(2, 2, 100, 100, device="cuda") > 0.3, False)):
                names = _cuda_fwd_kernels(q, k, v, attn_mask=mask, is_causal=causal)
                assert len(names) == 1, names
                if not hopper or d > 128:
                    want = "attn_fwd_kernel"
                elif env is None:
                    want = "attn_fwd_sm90_ws_kernel"
                else:
                    want = plain(d)
                assert want in names[0], (env, d, None if mask is None else mask.shape, names)
    monkeypatch.setenv("PYKERNELS_CUDA_ATTN_SM90", "0")
    names = _cuda_fwd_kernels(q[..., :64], k[..., :64], v[..., :64])
    assert len(names) == 1 and "attn_fwd_kernel" in names[0], names


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_cuda_backward_kernel_choice(monkeypatch):
    """Which C++ backward kernels one backward launches: on Hopper from an sm_90a build at head dims up to 128, the
    delta kernel and one attn_bwd_sm90_kernel, whose blocks are dK/dV's or dQ's (since 850d1f1; GQA included, where the
    dK/dV blocks past the kv heads leave at once); else, and with PYKERNELS_CUDA_ATTN_SM90=0, the delta kernel and the
    mma.sync dK/dV and dQ kernels. The same calls are checked against the references."""
    from torch.profiler import ProfilerActivity, profile
    hopper = _sm90a_device()
    for env in (None, "0"):
        _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_SM90", env)
        for d, hkv, causal in ((64, 4, False), (64, 2, True), (128, 1, False), (160, 2, False)):
            q, k, v = _inputs((2, 4, 130, d), (2, hkv, 130, d), (2, hkv, 130, d), BF16, "cuda")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:  # (the references launch no attn_ kernel)
                _check_against_ref(q, k, v, causal=causal, enable_gqa=hkv != 4, backend="cuda")
                torch.cuda.synchronize()
            names = [e.name for e in prof.events() if "attn_bwd" in e.name]
            assert sum("attn_bwd_pre_kernel" in n for n in names) == 1, names
            rest = [n for n in names if "attn_bwd_pre_kernel" not in n]
            if hopper and env is None and d <= 128:
                assert len(rest) == 1 and "attn_bwd_sm90_kernel" in rest[0], (d, rest)
            else:
                assert len(rest) == 2 and "attn_bwd_dkdv_kernel" in rest[0] and "attn_bwd_dq_kernel" in rest[1], \
                    (env, d, rest)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("scale", [-0.3, 0.0, 1e-3])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_cuda_backend_scale_sign(scale, causal, cuda_fwd):
    """A scale of any sign: the default forward's unmasked softmax takes the max of the raw scores, which needs a
    positive scale, so zero and negative scales take the kernels that scale first."""
    q, k, v = _inputs((2, 3, 200, 64), (2, 3, 200, 64), (2, 3, 200, 64), BF16, "cuda")
    _check_against_ref(q, k, v, causal=causal, scale=scale, backend="cuda")
    if cuda_fwd == "default" and _sm90a_device():
        names = _cuda_fwd_kernels(q.detach(), k.detach(), v.detach(), is_causal=causal, scale=scale)
        assert len(names) == 1 and ("attn_fwd_sm90_ws_kernel" in names[0]) == (scale > 0), (scale, names)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", CUDA_DENSE)
def test_gpu_cuda_backend_dense(dtype, b, hq, hkv, sq, sk, d, causal, cuda_fwd):
    q, k, v = _inputs((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), dtype, "cuda")
    out, _ = _check_against_ref(q, k, v, causal=causal, backend="cuda")
    assert "AttentionFunction" in out.grad_fn.name()  # the C++ op's autograd node


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_cuda_backward_without_keys(d):
    """Sk = 0 on the C++ backend: output and dQ 0 (the fused backward has no dK/dV block then: the convert kernel
    writes dQ from the sums the pre kernel zeroed), with and without dropout."""
    q = torch.randn(2, 3, 50, d, device="cuda", dtype=BF16, requires_grad=True)
    k, v = (torch.randn(2, 3, 0, d, device="cuda", dtype=BF16, requires_grad=True) for _ in range(2))
    for p in (0.0, 0.1):
        out = sdpa(q, k, v, dropout_p=p, backend="cuda")
        (dq,) = torch.autograd.grad(out, [q], torch.randn_like(out))
        assert torch.equal(out, torch.zeros_like(out)) and torch.equal(dq, torch.zeros_like(dq)), p


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_cuda_backend_masks_and_dead_rows(cuda_fwd):
    b, hq, hkv, s, d = 2, 4, 2, 300, 64
    q, k, v = _inputs((b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d), BF16, "cuda")
    # key padding, the second batch with no key at all: its output and gradients are 0
    kp = (torch.arange(s, device="cuda")[None, :] < torch.tensor([211, 0], device="cuda")[:, None]).view(b, 1, 1, s)
    out, grads = _check_against_ref(q, k, v, mask=kp, backend="cuda")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for g in grads:
        assert torch.equal(g[1], torch.zeros_like(g[1]))
    _check_against_ref(q, k, v, mask=torch.rand(b, 1, s, s, device="cuda") > 0.5, causal=True, backend="cuda")
    for mdtype in (torch.float32, BF16, torch.float16, torch.float64):
        _check_against_ref(q, k, v, mask=torch.randn(1, hq, s, s, device="cuda", dtype=mdtype), backend="cuda")
    # an additive mask with -inf rows (fully masked queries) and a -inf column
    add = torch.randn(b, 1, s, s, device="cuda")
    add[:, :, 5:40] = float("-inf")
    add[..., 7] = float("-inf")
    out, grads = _check_against_ref(q, k, v, mask=add, backend="cuda")
    assert torch.equal(out[:, :, 5:40], torch.zeros_like(out[:, :, 5:40]))
    assert torch.equal(grads[0][:, :, 5:40], torch.zeros_like(grads[0][:, :, 5:40]))


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("d,causal,dtype", [(64, False, BF16), (64, True, F16), (128, True, BF16), (256, False, BF16)])
def test_gpu_cuda_backend_key_padding_ranges(d, causal, dtype, cuda_fwd):
    """A key-only mask: the forward and dQ kernels visit only the key blocks between each batch's first and last
    valid key, and a dK/dV block whose keys are all masked writes zeros without visiting a query. Ranges that start
    and end inside a block, a hole inside the range, a batch with one valid key, one with none, left padding (under
    causal, queries before the first valid key have no key: output and dQ 0), boolean and additive masks."""
    b, hq, hkv, s = 4, 4, 2, 333
    q, k, v = _inputs((b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d), dtype, "cuda")
    pos = torch.arange(s, device="cuda")
    lo = torch.tensor([70, 0, 200, 0], device="cuda")[:, None]
    hi = torch.tensor([250, 333, 201, 0], device="cuda")[:, None]
    valid = (pos >= lo) & (pos < hi) & ~((pos >= 100) & (pos < 110))
    for mask in (valid.view(b, 1, 1, s),
                 torch.where(valid, torch.randn(b, s, device="cuda"), float("-inf")).to(dtype).view(b, 1, 1, s)):
        out, (dq, dk, dv) = _check_against_ref(q, k, v, mask=mask, causal=causal, backend="cuda")
        assert torch.equal(dk[3], torch.zeros_like(dk[3])) and torch.equal(dv[3], torch.zeros_like(dv[3]))
        dead = ~valid[:, None, None, :]  # keys no query sees get zero dK, dV
        assert torch.equal(dk.masked_fill(dead.transpose(-1, -2).expand_as(dk), 0), dk)
        assert torch.equal(dv.masked_fill(dead.transpose(-1, -2).expand_as(dv), 0), dv)
        if causal:
            assert torch.equal(out[0, :, :70], torch.zeros_like(out[0, :, :70]))
            assert torch.equal(dq[0, :, :70], torch.zeros_like(dq[0, :, :70]))


def _spans_mask(s: int, spans) -> torch.Tensor:
    """A (B, 1, 1, s) boolean key-padding mask, batch i's valid keys spans[i] = (lo, hi[, hole]): keys lo .. hi - 1,
    less keys 100 .. 109 where a third item is given."""
    pos = torch.arange(s, device="cuda")
    rows = []
    for span in spans:
        valid = (pos >= span[0]) & (pos < span[1])
        if len(span) > 2:
            valid &= ~((pos >= 100) & (pos < 110))
        rows.append(valid)
    return torch.stack(rows).view(len(spans), 1, 1, s)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_gpu_cuda_forward_key_padding_split(monkeypatch, dtype):
    """A boolean key-padding mask on the C++ forward (csrc/attention.cuh, fwd_key_ranges: D <= 64, not causal; without
    dropout where three consumers' tiles pad little): split by each batch's valid keys between the key-mask kernel
    (MODE 1, two consumers) for the batches whose valid keys are not one run (a hole, no key) and the unmasked
    three-consumer overlap kernel (MODE 0; with dropout two consumers, below) over every other batch's keys
    lo .. hi - 1, both with kRange true, the
    key-mask one launched even where it has no batch (it leaves at once); one key-mask kernel with
    PYKERNELS_CUDA_ATTN_FWD_RANGES=0 and at 100 rows (three consumers' 192-row tiles would pad them to 1.5x). Batches
    of every key, one key, a block and one key, left padding, a hole, no key (output 0, lse -inf), GQA, D = 40, 333
    and 1000 rows: output, lse and gradients against the references and the unsplit kernel's (close: the key-mask
    kernel adds its 0 / -inf addends before the max, so not bitwise); the ranges the caller passes
    (pykernels.attention._key_padding_range, auto's path) bitwise equal to those the op computes, and two calls back
    to back bitwise equal."""
    if not _sm90a_device():
        pytest.skip("the warp-specialised forward runs on compute capability 9.0 from an sm_90a build")
    from pykernels.attention import _key_padding_range

    def fwd(q, k, v, mask, kv_range=None):  # (the registered C++ op: output and lse)
        b, h, sq, _ = q.shape
        sk = k.shape[2]
        o, lse, _ = torch.ops.pykernels_cuda.attention_fwd(q, k, v, mask.expand(b, h, sq, sk), None, None, sq, sk, 0.0,
                                                            False, q.shape[-1] ** -0.5, kv_range)
        return o, lse

    def kinds(q, k, v, mask, **kw):  # (MODE, NW, kOvl, kMix, kRange) of each warp-specialised forward launched
        return [tuple(a[2:7]) for a in _ws_fwd_args(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1], **kw)]

    split = [("1", "2", "false", "false", "true"), ("0", "3", "true", "false", "true")]
    alone = [("1", "2", "false", "false", "false")]
    cases = (
        (6, 4, 2, 512, 64, [(0, 512), (0, 1), (0, 129), (300, 512), (70, 250, "hole"), (0, 0)]),
        (4, 3, 3, 1000, 40, [(0, 1000), (0, 999), (0, 500), (0, 17)]),
        (2, 2, 2, 333, 64, [(0, 333), (5, 6)]),
        (2, 2, 2, 100, 64, [(0, 100), (0, 60)]),
    )
    for b, hq, hkv, s, d, spans in cases:
        q, k, v = _inputs((b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d), dtype, "cuda")
        mask = _spans_mask(s, spans)
        qd, kd, vd = (t.detach() for t in (q, k, v))
        _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_RANGES", None)
        assert kinds(qd, kd, vd, mask) == (alone if s == 100 else split), (s, kinds(qd, kd, vd, mask))
        out, lse = fwd(qd, kd, vd, mask)
        again = fwd(qd, kd, vd, mask)
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1]), s
        given = fwd(qd, kd, vd, mask, _key_padding_range(mask))
        assert torch.equal(out, given[0]) and torch.equal(lse, given[1]), s
        dead = [i for i, span in enumerate(spans) if span[1] <= span[0]]
        for i in dead:
            assert torch.equal(out[i], torch.zeros_like(out[i])) and bool((lse[i] == float("-inf")).all()), i
        _check_against_ref(q, k, v, mask=mask, enable_gqa=hkv != hq, backend="cuda", what=f"split {s} d{d}")
        _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_RANGES", "0")
        assert kinds(qd, kd, vd, mask) == alone, s
        out0, lse0 = fwd(qd, kd, vd, mask)
        torch.testing.assert_close(lse, lse0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, out0, rtol=2e-2, atol=2e-2)
    _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_RANGES", None)
    q, k, v = _inputs((3, 4, 512, 64), (3, 4, 512, 64), (3, 4, 512, 64), dtype, "cuda")
    _check_against_ref(q, k, v, mask=_spans_mask(512, [(0, 512), (0, 300), (0, 257)]), backend="auto",
                       what="auto, the C++ forward split by the ranges it passes")
    # dropout (the keep mask attention_dropout_mask's, split or not): the unmasked half on two consumers whose
    # producer draws keep bits, over the runs from key 0 only (left padding goes to the key-mask kernel), also at
    # 100 rows (two consumers' tiles: no padding rule). (No one-key row here: its true dS is 0, the kernel's dK that
    # of delta = rowsum(dO O) from the bf16 output, 0.12-0.17 against the float64 0, split or not: H200 run428)
    for b, s, spans in ((5, 512, [(0, 512), (0, 300), (0, 129), (200, 512), (70, 250, "hole")]),
                        (2, 100, [(0, 100), (0, 60)])):
        q, k, v = _inputs((b, 4, s, 64), (b, 4, s, 64), (b, 4, s, 64), dtype, "cuda")
        mask = _spans_mask(s, spans)
        for env in (None, "0"):
            _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_RANGES", env)
            want = alone if env == "0" else [split[0], ("0", "2", "false", "false", "true")]
            assert kinds(q.detach(), k.detach(), v.detach(), mask, dropout_p=0.1) == want, (s, env)
            torch.manual_seed(6)
            seed = new_seed(q.device)
            torch.manual_seed(6)
            out = sdpa(q, k, v, mask, dropout_p=0.1, backend="cuda")
            _check_against_ref(q, k, v, mask=mask, dropout_p=0.1, out=out, what=f"split {s}, dropout, ranges {env}",
                               dropout_mask=attention_dropout_mask(seed, b, 4, s, s, 0.1, "cuda"))


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_cuda_backend_layouts(cuda_fwd):
    # the transformers layout ((B, S, H, D) storage seen as (B, H, S, D)), K / V broadcast over the batch with
    # stride 0, a query head broadcast over the kv heads, rows at a storage offset that is not 16-byte aligned
    b, h, s, d = 2, 4, 150, 64
    q = torch.randn(b, s, h, d, device="cuda", dtype=BF16).transpose(1, 2).requires_grad_(True)
    k0 = torch.randn(1, h, s, d, device="cuda", dtype=BF16, requires_grad=True)
    v0 = torch.randn(1, h, s, d, device="cuda", dtype=BF16, requires_grad=True)
    out = sdpa(q, k0.expand(b, h, s, d), v0.expand(b, h, s, d), is_causal=True, backend="cuda")
    assert out.stride() == q.stride()  # the output keeps q's layout
    ref = sdpa(q, k0.expand(b, h, s, d), v0.expand(b, h, s, d), is_causal=True, backend="reference")
    do = torch.randn_like(out)
    for a, r in zip((out, *_grads(out, (q, k0, v0), do)), (ref, *_grads(ref, (q, k0, v0), do))):
        torch.testing.assert_close(a, r, atol=3e-2, rtol=3e-2)
    kb, vb = (t.detach().expand(b, h, s, d).clone().requires_grad_(True) for t in (k0, v0))
    flat = torch.randn(b * h * s * d + 3, device="cuda", dtype=BF16)
    qo = flat[3:].view(b, h, s, d).detach().requires_grad_(True)  # 6 bytes past an aligned start
    _check_against_ref(qo, kb, vb, backend="cuda")
    q1 = torch.randn(b, 1, s, d, device="cuda", dtype=BF16, requires_grad=True)
    _check_against_ref(q1, kb, vb, backend="cuda")


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_cuda_tma_loads(monkeypatch):
    """The warp-specialised forward's producer and the backward's blocks load their tiles by TMA where the inputs are
    dense and TMA can address them (PYKERNELS_CUDA_ATTN_TMA=1 requires it: an error otherwise), else by cp.async
    (=0). Both fill shared memory alike, so outputs and gradients are bitwise equal, and each is checked against the
    references. Layouts: contiguous, the
    transformers (B, S, H, D) storage, q sliced from a packed qkv, a batch or head dim of 1; head dims whose second
    64-column box runs past d (80, 96) or whose only box does (16, 40); odd lengths; GQA; causal; a key-padding mask
    (the producer's other threads write the key addends while thread 0 issues the loads); a query the op copies
    first (6 bytes past alignment). Inputs TMA cannot take (stride-0 K / V, packed varlen sequences; in the backward a
    stride-0 output gradient, as ``out.sum().backward()`` gives) raise under =1 and fall back otherwise."""
    if not _sm90a_device():
        pytest.skip("the warp-specialised forward needs an sm_90a build on a compute-capability 9.0 device")
    monkeypatch.delenv("PYKERNELS_CUDA_ATTN_SM90", raising=False)
    # the pair on both sides (the fused backward, TMA only, adds dQ in no fixed order: its own tests)
    monkeypatch.setenv("PYKERNELS_CUDA_ATTN_FUSED_DQ", "0")

    def both(q, k, v, **kw):
        runs = []
        do = None
        for env in ("1", "0"):
            monkeypatch.setenv("PYKERNELS_CUDA_ATTN_TMA", env)
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = sdpa(qq, kk, vv, backend="cuda", **kw)
            do = torch.randn_like(out) if do is None else do
            runs.append((out, *_grads(out, (qq, kk, vv), do)))
        for a, b in zip(*runs):
            assert torch.equal(a, b)
        monkeypatch.setenv("PYKERNELS_CUDA_ATTN_TMA", "1")
        _check_against_ref(q, k, v, causal=kw.get("is_causal", False), mask=kw.get("attn_mask"), backend="cuda",
                           do=do)

    dev = "cuda"
    for (b, hq, hkv, sq, sk, d, causal) in [(2, 4, 4, 200, 200, 64, True), (2, 8, 2, 333, 300, 128, False),
                                            (1, 3, 1, 17, 1000, 80, True), (2, 2, 2, 129, 127, 96, False),
                                            (1, 2, 2, 300, 257, 16, True), (1, 1, 1, 1000, 1000, 40, False)]:
        for dtype in (BF16, F16):
            q, k, v = _inputs((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), dtype, dev)
            both(q, k, v, is_causal=causal)
    b, s, h, d = 2, 150, 4, 64
    q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=BF16).transpose(1, 2).requires_grad_(True) for _ in range(3))
    both(q, k, v, is_causal=True)
    qkv = torch.randn(b, s, 3, h, 128, device=dev, dtype=BF16)
    q, k, v = (qkv[:, :, i].transpose(1, 2).requires_grad_(True) for i in range(3))
    both(q, k, v)
    q, k, v = _inputs((3, 4, 333, 64), (3, 2, 333, 64), (3, 2, 333, 64), BF16, dev)
    kp = (torch.arange(333, device=dev)[None, :] < torch.tensor([333, 140, 0], device=dev)[:, None]).view(3, 1, 1, 333)
    # (the key-mask kernel alone: with TMA its split by key ranges sends the one-run batches to the unmasked
    # three-consumer kernel, which cp.async does not feed, test_gpu_cuda_forward_key_padding_split)
    monkeypatch.setenv("PYKERNELS_CUDA_ATTN_FWD_RANGES", "0")
    both(q, k, v, attn_mask=kp)

    # a query 6 bytes past alignment: the op copies it (cp.async needs 16-byte rows too), then TMA takes it
    flat = torch.randn(2 * 2 * 150 * 64 + 3, device=dev, dtype=BF16)
    q = flat[3:].view(2, 2, 150, 64).requires_grad_(True)
    k, v = (torch.randn(2, 2, 150, 64, device=dev, dtype=BF16, requires_grad=True) for _ in range(2))
    both(q, k, v, is_causal=True)

    k0 = torch.randn(1, 2, 150, 64, device=dev, dtype=BF16)
    args = (k, k0.expand(2, 2, 150, 64), k0.expand(2, 2, 150, 64))  # stride 0 over the batch
    monkeypatch.setenv("PYKERNELS_CUDA_ATTN_TMA", "1")
    with pytest.raises(RuntimeError, match="PYKERNELS_CUDA_ATTN_TMA=1"):
        sdpa(*args, backend="cuda")
    monkeypatch.delenv("PYKERNELS_CUDA_ATTN_TMA")
    torch.testing.assert_close(sdpa(*args, backend="cuda"), sdpa(*args, backend="reference"), atol=2e-2, rtol=2e-2)
    # an output gradient of stride 0 over batch and heads (the op keeps it: its rows are 16-byte aligned), straight into
    # the C++ op's autograd: the backward raises under =1, else loads it by cp.async, bitwise as TMA loads it copied
    def call():
        return torch.ops.pykernels_cuda.attention(q, k, v, None, None, None, 150, 150, 0.0, True, 0.125, None)

    do = torch.randn(1, 1, 150, 64, device=dev, dtype=BF16).expand(2, 2, 150, 64)
    monkeypatch.setenv("PYKERNELS_CUDA_ATTN_TMA", "1")
    with pytest.raises(RuntimeError, match="PYKERNELS_CUDA_ATTN_TMA=1: the backward"):
        torch.autograd.grad(call(), (q, k, v), do)
    expected = torch.autograd.grad(call(), (q, k, v), do.contiguous())
    monkeypatch.delenv("PYKERNELS_CUDA_ATTN_TMA")
    for a, e in zip(torch.autograd.grad(call(), (q, k, v), do), expected):
        assert torch.equal(a, e)
    # packed varlen sequences: the forward loads them by TMA (=1 takes them, bitwise the cp.async forward's), the
    # backward cannot (=1 raises there)
    lq = [100, 7]
    qv, kv, vv, cu_q, cu_k = _varlen_case(lq, lq, 2, 2, 64, BF16, dev)
    outs = []
    for env in ("1", "0"):
        monkeypatch.setenv("PYKERNELS_CUDA_ATTN_TMA", env)
        outs.append(varlen_attention(qv, kv, vv, cu_q, cu_k, 100, 100, backend="cuda"))
    assert torch.equal(outs[0], outs[1])
    monkeypatch.setenv("PYKERNELS_CUDA_ATTN_TMA", "1")
    with pytest.raises(RuntimeError, match="PYKERNELS_CUDA_ATTN_TMA=1: the backward"):
        torch.autograd.grad(varlen_attention(qv, kv, vv, cu_q, cu_k, 100, 100, backend="cuda"), (qv, kv, vv),
                            torch.ones(107, 2, 64, device=dev, dtype=BF16))


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("causal,d,s", [(True, 64, 200), (False, 128, 200), (True, 96, 77), (False, 256, 130)])
def test_gpu_cuda_backend_dropout_and_determinism(causal, d, s, cuda_fwd):
    """The C++ kernels' mask (lanes sharing one Philox call per 8 keys: the forward's and dQ's quads, dK/dV's octets)
    is pykernels.attention_dropout_mask: output and the three gradients against the reference with that mask, on the
    wgmma kernels (D <= 128) and the mma.sync ones (D = 256), odd lengths."""
    b, hq, hkv = 2, 4, 2
    q, k, v = _inputs((b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d), BF16, "cuda")
    torch.manual_seed(5)
    seed = new_seed(q.device)
    torch.manual_seed(5)
    out = sdpa(q, k, v, dropout_p=0.2, is_causal=causal, backend="cuda")
    dmask = attention_dropout_mask(seed, b, hq, s, s, 0.2, "cuda")
    seen = torch.ones(s, s, device="cuda").tril() if causal else torch.ones(s, s, device="cuda")
    keep = (dmask.float() * seen).sum() / seen.sum() / (b * hq)
    assert abs(keep.item() - 0.8) < 0.01
    do = torch.randn_like(out)
    _, grads = _check_against_ref(q, k, v, causal=causal, dropout_p=0.2, dropout_mask=dmask, out=out, do=do)
    # the Triton backend draws the same mask for the same torch seed
    torch.manual_seed(5)
    out_t = sdpa(q, k, v, dropout_p=0.2, is_causal=causal, backend="triton")
    torch.testing.assert_close(out, out_t, atol=2e-2, rtol=2e-2)
    # same seed again: bitwise the same output, dK and dV; dQ too with deterministic=True (the pair, no atomics), else
    # (the fused backward at D <= 128 on Hopper adds dQ by bulk reductions) within a rounding of the first
    for det in (False, True):
        torch.manual_seed(5)
        out2 = sdpa(q, k, v, dropout_p=0.2, is_causal=causal, backend="cuda", deterministic=det)
        assert torch.equal(out, out2)
        g2 = _grads(out2, (q, k, v), do)
        assert torch.equal(grads[1], g2[1]) and torch.equal(grads[2], g2[2])
        torch.testing.assert_close(grads[0], g2[0], rtol=1e-2, atol=1e-2 * grads[0].abs().max().item())
        if det:
            torch.manual_seed(5)
            out3 = sdpa(q, k, v, dropout_p=0.2, is_causal=causal, backend="cuda", deterministic=True)
            assert all(torch.equal(a, b_) for a, b_ in zip(g2, _grads(out3, (q, k, v), do)))


def _fused_bwd_kernels(call) -> list[str]:
    """The attn_ kernels one backward of ``call()`` launches, by name (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    out = call()
    do = torch.randn_like(out)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out.backward(do)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "attn_" in e.name]


FUSED_BWD = ", true, 1>"  # the fused backward kernel's template tail in a profiler name (attn_bwd_sm90_kernel)


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_cuda_fused_backward_fp16_and_a_bulk_reduction_at_a_tail(monkeypatch):
    """fp16 takes the fused backward too (dS K on fp16 wgmma; D = 64, and D = 128's deferred kernel); 1000 queries
    leave a tail block of 40 rows (64-query blocks), whose bulk reduction must add only those rows (the next head's
    rows follow in the buffer), and 968 one of 8; the dQ sums, allocated uninitialised, are zeroed by the pre kernel
    (checked over a poisoned allocator cache)."""
    monkeypatch.delenv("PYKERNELS_CUDA_ATTN_FUSED_DQ", raising=False)
    for s, d in ((1000, 64), (968, 64), (1000, 128)):
        q, k, v = _inputs((2, 3, s, d), (2, 3, s, d), (2, 3, s, d), F16, "cuda")
        torch.manual_seed(4)
        seed = new_seed(q.device)
        torch.manual_seed(4)
        out = sdpa(q, k, v, dropout_p=0.1, backend="cuda")
        # poison the allocator's cache: the dQ sums are allocated uninitialised and zeroed by the pre kernel, so a
        # row it missed would add into NaN here (dq_acc's own size, and a large block the allocator splits)
        poison = [torch.full((n,), float("nan"), device="cuda") for n in (2 * 3 * s * d, 1 << 24)]
        del poison
        _check_against_ref(q, k, v, dropout_p=0.1,
                           dropout_mask=attention_dropout_mask(seed, 2, 3, s, s, 0.1, "cuda"), out=out)
        if _sm90a_device():
            names = _fused_bwd_kernels(lambda: sdpa(q, k, v, dropout_p=0.1, backend="cuda"))
            tail = ", true, 2>" if d > 64 else FUSED_BWD
            assert any(tail in n for n in names) and any("attn_dq_convert" in n for n in names), names


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("p", [0.15, 0.0])
@pytest.mark.parametrize("d,hkv,causal,mask", [
    (64, 4, False, None), (64, 2, True, None), (40, 4, False, "keys"), (64, 1, True, "any"),
    (128, 4, True, None), (96, 2, False, "keys"), (128, 1, False, "any")])
def test_gpu_cuda_fused_backward(monkeypatch, p, d, hkv, causal, mask):
    """The C++ backward's fused kernel (Hopper, sm_90a build, dense inputs, D <= 128): the dK/dV blocks add dQ = dS K
    into an fp32 buffer (K^T dS^T on wgmma, dS through shared memory), then one kernel converts it; no dQ
    blocks. Taken with or without dropout (PYKERNELS_CUDA_ATTN_FUSED_DQ unset, or 'a', its synonym), never with
    deterministic=True or '0'; dQ goes through a tile in shared memory, added by bulk reductions. D = 64 (FUSED = 1):
    dQ^T in its own iteration; D = 128 (FUSED = 2, D = 96 too): an iteration late. Output and gradients against the
    references (with the kernels' dropout mask), odd lengths, GQA, masks."""
    monkeypatch.delenv("PYKERNELS_CUDA_ATTN_FUSED_DQ", raising=False)
    b, hq, s = 2, 4, 203
    q, k, v = _inputs((b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d), BF16, "cuda")
    m = None
    if mask == "keys":
        m = torch.ones(b, 1, 1, s, dtype=torch.bool, device="cuda")
        m[0, ..., 150:] = False
        m[1, ..., :30] = False
    elif mask == "any":
        m = torch.rand(b, 1, s, s, device="cuda") > 0.3
    torch.manual_seed(3)
    seed = new_seed(q.device)
    dmask = attention_dropout_mask(seed, b, hq, s, s, p, "cuda") if p else None
    call = lambda **kw: sdpa(q, k, v, m, dropout_p=p, is_causal=causal, enable_gqa=hkv != hq,  # noqa: E731
                             backend="cuda", **kw)
    torch.manual_seed(3)
    out = call()
    _check_against_ref(q, k, v, mask=m, causal=causal, dropout_p=p, dropout_mask=dmask, enable_gqa=hkv != hq,
                       out=out)
    if not _sm90a_device():
        return
    tail = ", true, 2>" if d > 64 else FUSED_BWD
    for env in (None, "a"):
        _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FUSED_DQ", env)
        fused = [n for n in _fused_bwd_kernels(call) if "attn_bwd_sm90_kernel" in n or "attn_dq_convert" in n]
        assert len(fused) == 2 and tail in fused[0] and "attn_dq_convert_kernel" in fused[1], (env, fused)
    for kw in (dict(deterministic=True), dict()):  # the pair: deterministic, or the switch off
        if not kw:
            monkeypatch.setenv("PYKERNELS_CUDA_ATTN_FUSED_DQ", "0")
        names = _fused_bwd_kernels(lambda: call(**kw))
        assert not any("attn_dq_convert" in n or ", true, 1>" in n or ", true, 2>" in n for n in names), (kw, names)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("p", [0.1, 0.0])
def test_gpu_cuda_fused_backward_d128_long(monkeypatch, p):
    """The fused backward at D = 128 over many query blocks a key block (S = 1000: 16 query blocks a head, two heads a
    key block, up to 32 iterations, so each Q / dO buffer, each dS tile and each mbarrier that hands them over turns
    over several times), causal with and without dropout, against the reference with the kernels' mask."""
    monkeypatch.delenv("PYKERNELS_CUDA_ATTN_FUSED_DQ", raising=False)
    b, hq, s, d = 2, 4, 1000, 128
    q, k, v = _inputs((b, hq, s, d), (b, 2, s, d), (b, 2, s, d), BF16, "cuda")
    torch.manual_seed(5)
    dmask = attention_dropout_mask(new_seed(q.device), b, hq, s, s, p, "cuda") if p else None
    torch.manual_seed(5)
    out = sdpa(q, k, v, dropout_p=p, is_causal=True, enable_gqa=True, backend="cuda")
    _check_against_ref(q, k, v, causal=True, dropout_p=p, dropout_mask=dmask, enable_gqa=True, out=out)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("d,sq,sk,causal,p", [
    (64, 150, 333, False, 0.0), (64, 333, 150, True, 0.1), (128, 150, 333, True, 0.1), (128, 1000, 77, False, 0.1),
    (128, 333, 150, True, 0.0)])
def test_gpu_cuda_fused_backward_cross(monkeypatch, d, sq, sk, causal, p):
    """The fused backward with Sq != Sk (causal aligned top-left, as torch): its key blocks (64 keys at D = 64, 128 on
    two warpgroups at D = 128) against query blocks of another length, with and without dropout, against the
    reference; the fused kernel is the one that ran."""
    monkeypatch.delenv("PYKERNELS_CUDA_ATTN_FUSED_DQ", raising=False)
    b, hq, hkv = 2, 4, 2
    q, k, v = _inputs((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), BF16, "cuda")
    torch.manual_seed(7)
    dmask = attention_dropout_mask(new_seed(q.device), b, hq, sq, sk, p, "cuda") if p else None
    call = lambda: sdpa(q, k, v, dropout_p=p, is_causal=causal, enable_gqa=True, backend="cuda")  # noqa: E731
    torch.manual_seed(7)
    out = call()
    _check_against_ref(q, k, v, causal=causal, dropout_p=p, dropout_mask=dmask, enable_gqa=True, out=out)
    if _sm90a_device():
        names = _fused_bwd_kernels(call)
        tail = ", true, 2>" if d > 64 else FUSED_BWD
        assert any(tail in n for n in names) and any("attn_dq_convert" in n for n in names), names


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("causal,d", [(False, 64), (True, 128), (True, 96)])
def test_gpu_cuda_backend_varlen(causal, d, cuda_fwd):
    lq, lk = [1000, 1, 0, 513, 77, 3], [900, 5, 3, 513, 77, 0]
    q, k, v, cu_q, cu_k = _varlen_case(lq, lk, 8, 2, d, BF16, "cuda", extra_rows=5)
    out = varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, backend="cuda")
    do = torch.randn_like(out)
    grads = _grads(out, (q, k, v), do)
    # rows past cu_seqlens[-1] are 0, output and gradients
    for t, cu in ((out, cu_q), (grads[0], cu_q), (grads[1], cu_k), (grads[2], cu_k)):
        assert torch.equal(t[int(cu[-1]):], torch.zeros_like(t[int(cu[-1]):]))
    _check_varlen_per_sequence(out, grads, q, k, v, do, cu_q, cu_k, causal, BF16)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_cuda_varlen_deterministic(d):
    """varlen_attention(deterministic=True) on the C++ backend, and torch's deterministic mode with the default None:
    the backward takes the pair (no attn_dq_convert: dQ by its own blocks, no bulk reductions) and two runs give
    bitwise the same gradients. (Until session 45 varlen_attention dropped deterministic=True on its way to the C++
    op, whose fused backward adds dQ in no fixed order.)"""
    lq = [700, 1, 0, 513, 77, 300]
    q, k, v, cu, _ = _varlen_case(lq, lq, 4, 2, d, BF16, "cuda")

    def call(**kw):
        return varlen_attention(q, k, v, cu, cu, max(lq), max(lq), causal=True, backend="cuda", **kw)

    do = torch.randn(q.shape, device="cuda", dtype=BF16)
    if _sm90a_device():  # (the fused backward otherwise, on Hopper at these head dims)
        assert any("attn_dq_convert" in n for n in _fused_bwd_kernels(call))
    for mode in ("flag", "torch"):
        prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(mode == "torch")
        try:
            kw = dict(deterministic=True) if mode == "flag" else dict()
            names = _fused_bwd_kernels(lambda: call(**kw))
            assert not any("attn_dq_convert" in n for n in names), (mode, names)
            runs = [_grads(call(**kw), (q, k, v), do) for _ in range(2)]
        finally:
            torch.use_deterministic_algorithms(prev)
        for a, b in zip(*runs):
            assert torch.equal(a, b), mode


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("d,env,val", [(64, None, None), (128, None, None), (64, "PYKERNELS_CUDA_ATTN_FWD_ORDER", "0"),
                                       (128, "PYKERNELS_CUDA_ATTN_SM90", "0"), (64, "PYKERNELS_CUDA_ATTN_FILL", "launch")])
def test_gpu_cuda_varlen_rows_outside_the_sequences_are_zero(monkeypatch, d, env, val):
    """The C++ op allocates its output, lse and gradients uninitialised (poisoned with NaN in the tests) and fills the
    rows that no sequence holds: rows before cu_seqlens[0] and from cu_seqlens[-1] on, of o, dq, dk and dv, are 0 and
    of lse -inf (q, k, v hold NaN there: no kernel reads them into a sequence). The forward's by the order kernel's
    spare blocks, or by a launch of their own where no order kernel runs (``env`` = '0': tile_at's walk; the kernels
    without warp specialisation); the gradients' by the pre kernel (attention.cuh's grads_outside); both by launches
    of their own under PYKERNELS_CUDA_ATTN_FILL=launch. cu_seqlens given as strided views (copied contiguous); each
    sequence against the reference."""
    if env is not None:
        monkeypatch.setenv(env, val)
    lq, lk, first, extra = [17, 0, 130, 1], [5, 9, 200, 0], 3, 6
    cu_q = torch.tensor([first] + (first + torch.tensor(lq).cumsum(0)).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([first] + (first + torch.tensor(lk).cumsum(0)).tolist(), dtype=torch.int32, device="cuda")
    tq, tk = int(cu_q[-1]) + extra, int(cu_k[-1]) + extra
    q, k, v = _inputs((tq, 4, d), (tk, 2, d), (tk, 2, d), BF16, "cuda", requires_grad=False)
    for t, cu in ((q, cu_q), (k, cu_k), (v, cu_k)):
        t[:first] = float("nan")
        t[int(cu[-1]):] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    strided = [torch.stack([c, c], 1)[:, 0] for c in (cu_q, cu_k)]
    assert not strided[0].is_contiguous()
    out = varlen_attention(q, k, v, *strided, max(lq), max(lk), backend="cuda")
    do = torch.randn_like(out)
    grads = _grads(out, (q, k, v), do)
    for t, cu in ((out, cu_q), (grads[0], cu_q), (grads[1], cu_k), (grads[2], cu_k)):
        for rows in (t[:first], t[int(cu[-1]):]):
            assert torch.equal(rows, torch.zeros_like(rows))
    _check_varlen_per_sequence(out, grads, q, k, v, do, cu_q, cu_k, False, BF16)
    import pykernels._C  # noqa: F401  (registers torch.ops.pykernels_cuda)
    o2, lse, _ = torch.ops.pykernels_cuda.attention_fwd(q.detach(), k.detach(), v.detach(), None, cu_q, cu_k, max(lq),
                                                        max(lk), 0.0, False, d ** -0.5)
    assert torch.equal(o2, out)
    assert lse.shape == (4, tq)
    for cols in (lse[:, :first], lse[:, int(cu_q[-1]):]):
        assert torch.equal(cols, torch.full_like(cols, float("-inf")))
    assert torch.isfinite(lse[:, first:first + lq[0]]).all()


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_cuda_backend_varlen_dropout_is_tritons_mask():
    """Varlen dropout keys Philox by the max lengths and the positions inside each sequence, as the Triton kernels
    do: the same torch seed gives the same mask, so the two backends' outputs and gradients agree."""
    lq, lk = [300, 0, 77, 128], [250, 9, 77, 0]
    q, k, v, cu_q, cu_k = _varlen_case(lq, lk, 4, 2, 64, BF16, "cuda")
    runs = []
    for backend in ("cuda", "triton"):
        torch.manual_seed(3)
        out = varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), dropout_p=0.25, causal=True, backend=backend)
        runs.append((out, *_grads(out, (q, k, v), torch.ones_like(out))))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


def _varlen_poisoned(lengths, hq, hkv, d, extra, device):
    """A packed self-attention batch (bf16) whose rows past cu_seqlens[-1] hold NaN: no kernel may read them into a
    sequence's results (a P of 0 times a NaN is NaN)."""
    q, k, v, cu, _ = _varlen_case(lengths, lengths, hq, hkv, d, BF16, device, extra_rows=extra)
    end = int(cu[-1])
    with torch.no_grad():
        for t in (q, k, v):
            t[end:] = float("nan")
    return q, k, v, cu


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (40, False), (128, True), (96, False)])
def test_gpu_cuda_varlen_tma_forward_and_fused_backward(monkeypatch, d, causal):
    """Packed varlen sequences on Hopper: the forward's producer loads them by TMA as rows of a batch of one (each
    sequence's last V block by cp.async, zero-filled past the sequence), and the backward runs the fused kernel by
    TMA over the packed rows (FUSED = 3 at D <= 64, the deferred FUSED = 4 at 64 < D <= 128: a tile that runs past its
    sequence zeroed there once it lands; dq_acc over the packed rows, swizzled by each sequence's offset), or with
    PYKERNELS_CUDA_ATTN_FUSED_DQ=c the cp.async twin (D <= 64) or the pair. Sequence offsets that are not multiples
    of 8, a tile's worth of lengths and 1, an empty sequence, and NaN in the rows past cu_seqlens[-1]: each
    sequence's output and gradients against the reference, those rows' zero; the forward bitwise the cp.async forward's (PYKERNELS_CUDA_ATTN_TMA=0); the kernels that ran, by name."""
    monkeypatch.delenv("PYKERNELS_CUDA_ATTN_TMA", raising=False)
    lengths = [300, 1, 129, 0, 77, 256, 13]
    q, k, v, cu = _varlen_poisoned(lengths, 4, 2, d, 9, "cuda")
    mx = max(lengths)
    call = lambda: varlen_attention(q, k, v, cu, cu, mx, mx, causal=causal, backend="cuda")  # noqa: E731
    end = int(cu[-1])
    do = None
    runs = []
    # (D = 128: the deferred kernel over packed rows, FUSED = 4; 'c' the pair there)
    for env, kernel in ((None, ", true, 3>" if d <= 64 else ", true, 4>"), ("c", ", false, 1>" if d <= 64 else None)):
        _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FUSED_DQ", env)
        out = call()
        do = torch.randn_like(out) if do is None else do
        grads = _grads(out, (q, k, v), do)
        runs.append(grads)
        for t in (out, *grads):
            assert torch.equal(t[end:], torch.zeros_like(t[end:]))
        _check_varlen_per_sequence(out, grads, q, k, v, do, cu, cu, causal, BF16)
        if _sm90a_device():
            names = _fused_bwd_kernels(call)
            if kernel is not None:
                assert any(kernel in n for n in names) and any("attn_dq_convert" in n for n in names), (env, names)
            else:  # (the pair)
                assert not any("attn_dq_convert" in n for n in names), names
    # TMA with the tails zeroed fills shared memory as the twin's zero-filling cp.async does: dK and dV bitwise equal
    # (dQ's bulk reductions add in no fixed order)
    if d <= 64:
        assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])
    monkeypatch.setenv("PYKERNELS_CUDA_ATTN_TMA", "0")
    assert torch.equal(call(), out)
    monkeypatch.delenv("PYKERNELS_CUDA_ATTN_TMA")
    # the pair where the backward must be reproducible: within a rounding of the fused dQ
    dq_det = _grads(varlen_attention(q, k, v, cu, cu, mx, mx, causal=causal, backend="cuda", deterministic=True),
                    (q, k, v), do)[0]
    torch.testing.assert_close(dq_det[:end], grads[0][:end], rtol=1e-2, atol=1e-2 * grads[0][:end].abs().max().item())


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("d,causal,hkv,n", [(64, False, 4, 40), (64, True, 2, 40), (128, False, 1, 300),
                                           (128, True, 4, 12), (64, False, 4, 1030)])
def test_gpu_cuda_varlen_forward_walk_order(monkeypatch, d, causal, hkv, n):
    """The warp-specialised forward walks packed sequences in the order attn_fwd_order_kernel writes (sequences by
    key blocks, most first, rounds alternating; up to 1024 sequences, tile_at's walk past that): each tile is computed
    as in tile_at's walk (PYKERNELS_CUDA_ATTN_FWD_ORDER=0), so the output and the (deterministic) gradients are
    bitwise equal; lengths 0..700 (empty sequences, one key block and six), GQA, causal, 1030 sequences (tile_at's
    walk both times); against the reference per sequence."""
    g = torch.Generator().manual_seed(n + d)
    lengths = torch.randint(0, 700 if n <= 300 else 40, (n,), generator=g).tolist()
    lengths[0] = 0
    q, k, v, cu, _ = _varlen_case(lengths, lengths, 4, hkv, d, BF16, "cuda")
    mx = max(lengths)
    runs = []
    do = None
    for env in (None, "0"):
        _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_ORDER", env)
        out = varlen_attention(q, k, v, cu, cu, mx, mx, causal=causal, backend="cuda", deterministic=True)
        do = torch.randn_like(out) if do is None else do
        runs.append((out, *_grads(out, (q, k, v), do)))
    for name, a, e in zip(("out", "dq", "dk", "dv"), *runs):
        assert torch.equal(a, e), (name, (a.float() - e.float()).abs().max().item())
    # (against the reference: the first 64 sequences of the 1030, whose gradients are the pair's as before)
    cu_ref = cu[:65]
    _check_varlen_per_sequence(runs[0][0], runs[0][1:], q, k, v, do, cu_ref, cu_ref, causal, BF16)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_cuda_varlen_packed_qkv_strides(d):
    """Packed varlen q, k, v sliced from one (T, 3, H, D) buffer (flash-attn's qkvpacked layout: rows 3 H D apart), on
    the TMA maps over packed rows: output bitwise the contiguous copies' (the same tiles land), dK and dV too at D = 64
    (the same fused kernel), dQ within a rounding (bulk reductions in no fixed order); at D = 128 against the
    reference."""
    lengths = [129, 300, 0, 65]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    qkv = torch.randn(int(cu[-1]), 3, 4, d, device="cuda", dtype=BF16)
    strided = [qkv[:, i].requires_grad_(True) for i in range(3)]
    dense = [t.detach().contiguous().requires_grad_(True) for t in strided]
    runs = []
    for q, k, v in (strided, dense):
        out = varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), backend="cuda")
        do = torch.ones_like(out) if not runs else runs[0][-1]
        runs.append((out, *_grads(out, (q, k, v), do), do))
    assert torch.equal(runs[0][0], runs[1][0])
    if d <= 64:
        assert torch.equal(runs[0][2], runs[1][2]) and torch.equal(runs[0][3], runs[1][3])
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-2, atol=1e-2 * runs[1][1].abs().max().item())
    _check_varlen_per_sequence(runs[0][0], runs[0][1:4], *strided, runs[0][4], cu, cu, False, BF16)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_cuda_ws_forward_keep_bits_by_producer(monkeypatch, d):
    """The warp-specialised forward with dropout: its producer warpgroup draws most keep bits into shared memory
    (default: 12 of a key block's 16 n-tiles, the consumers the rest) or its consumers draw all of them
    (PYKERNELS_CUDA_ATTN_FWD_DRAWS=consumers, as before): the same mask and the
    same arithmetic, so the outputs are bitwise equal, dense (odd length, causal, GQA), with a key-padding
    mask (whose consumers always draw) and packed sequences (a last tile of one row, an empty sequence)."""
    torch.manual_seed(0)
    q, k, v = _inputs((2, 4, 203, d), (2, 2, 203, d), (2, 2, 203, d), BF16, "cuda", requires_grad=False)
    keys = torch.ones(2, 1, 1, 203, dtype=torch.bool, device="cuda")
    keys[1, ..., 150:] = False
    lengths = [300, 1, 129, 0, 77]
    qp, kp, vp, cu = _varlen_poisoned(lengths, 4, 2, d, 9, "cuda")
    calls = {
        "dense": lambda: sdpa(q, k, v, dropout_p=0.2, enable_gqa=True, backend="cuda"),
        "causal": lambda: sdpa(q, k, v, dropout_p=0.2, is_causal=True, enable_gqa=True, backend="cuda"),
        "keys": lambda: sdpa(q, k, v, keys, dropout_p=0.2, enable_gqa=True, backend="cuda"),
        "packed": lambda: varlen_attention(qp, kp, vp, cu, cu, max(lengths), max(lengths), dropout_p=0.2,
                                           backend="cuda"),
    }
    _bitwise_across_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_DRAWS", (None, "consumers"), calls,
                        valid=lambda name, o: o[:int(cu[-1])] if name == "packed" else o)


def _cuda_fwd(q, k, v, causal=False):
    """The C++ forward op without autograd, dense (b, h, s, d) inputs, no mask or dropout: (o, lse)."""
    o, lse, _ = torch.ops.pykernels_cuda.attention_fwd(q, k, v, None, None, None, q.shape[2], k.shape[2], 0.0, causal,
                                                        q.shape[-1] ** -0.5)
    return o, lse


def _bitwise_across_env(monkeypatch, switch, values, calls, valid=None):
    """Each of ``calls`` (name: a call returning a tensor or a tuple of them) under each value of the environment
    switch (None: unset), seeded alike, and once more right after (back to back: a second call's barriers and staging
    tiles follow the first's): the repeat bitwise equal to it, every value's outputs bitwise equal to the first
    value's, and the first output free of NaN (``valid(name, out)``: the part of it that must be)."""
    for name, call in calls.items():
        outs = []
        for env in values:
            _set_env(monkeypatch, switch, env)
            runs = []
            for _ in range(2):
                torch.manual_seed(5)
                out = call()
                runs.append([t.detach().clone() for t in ((out,) if isinstance(out, torch.Tensor) else out)])
            assert all(torch.equal(a, b) for a, b in zip(*runs)), (name, env, "again")
            outs.append(runs[0])
        first = valid(name, outs[0][0]) if valid is not None else outs[0][0]
        assert not first.isnan().any(), name
        for env, other in zip(values[1:], outs[1:]):
            assert all(torch.equal(a, b) for a, b in zip(outs[0], other)), (name, env)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_gpu_cuda_ws_forward_stores_o_by_tma(monkeypatch, dtype):
    """The warp-specialised forward at D <= 64 on dense inputs stores O through shared memory by TMA (default) or from
    registers (PYKERNELS_CUDA_ATTN_FWD_STORE=registers, as before): the same values, so O and the lse are bitwise
    equal, at head dims the map clips to (16, 40), lengths whose last tile leaves a consumer warpgroup no row (1, 17,
    203), q in (b, s, h, d) memory (the map's other dimension order), GQA, causal, dropout and a key-padding mask; and
    a second call with other inputs right after (the staging tiles' reuse across tiles and calls)."""
    q, k, v = _inputs((2, 4, 203, 64), (2, 2, 203, 64), (2, 2, 203, 64), dtype, "cuda", requires_grad=False)
    keys = torch.ones(2, 1, 1, 203, dtype=torch.bool, device="cuda")
    keys[1, ..., 150:] = False
    qt = torch.randn(3, 1000, 6, 40, dtype=dtype, device="cuda").transpose(1, 2)  # (b, h, s, d) view of (b, s, h, d)
    kt, vt = (torch.randn(3, 1000, 6, 40, dtype=dtype, device="cuda").transpose(1, 2) for _ in range(2))
    q1, k1, v1 = (torch.randn(2, 3, n, 16, dtype=dtype, device="cuda") for n in (17, 1, 1))
    ql, kl, vl = (torch.randn(1, 2, 17, 64, dtype=dtype, device="cuda") for _ in range(3))

    calls = {
        "dense": lambda: _cuda_fwd(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)),
        "causal": lambda: _cuda_fwd(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal=True),
        "transposed d40": lambda: _cuda_fwd(qt, kt, vt, causal=True),
        "d16 keys 1": lambda: _cuda_fwd(q1, k1, v1),
        "one tile of 17": lambda: _cuda_fwd(ql, kl, vl),
        "gqa dropout": lambda: (sdpa(q, k, v, dropout_p=0.2, enable_gqa=True, backend="cuda"),),
        "key padding": lambda: (sdpa(q, k, v, keys, enable_gqa=True, backend="cuda"),),
    }
    _bitwise_across_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_STORE", (None, "registers"), calls)
    # and the TMA store against the references (the layout and the clipped columns and rows)
    _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_STORE", None)
    for args in ((qt, kt, vt), (q1, k1, v1)):
        leaves = [t.detach().clone().requires_grad_(True) for t in args]
        _check_against_ref(*leaves, backend="cuda", what="tma store")


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("switch,on", [("PYKERNELS_CUDA_ATTN_FWD_SOFT_TURN", "1"),
                                       ("PYKERNELS_CUDA_ATTN_FWD_FENCE", "1"), ("PYKERNELS_CUDA_ATTN_FWD_WG", "3"),
                                       ("PYKERNELS_CUDA_ATTN_FWD_OVERLAP", "1"), ("PYKERNELS_CUDA_ATTN_FWD_MIX", "1")],
                         ids=["softmax_turn", "fence", "three_consumers", "overlap", "mixed_heads"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_gpu_cuda_ws_forward_switches(monkeypatch, dtype, switch, on):
    """Five switches of the warp-specialised forward that change only when or how its consumers wait, or how many
    share a tile, never what any row computes (PYKERNELS_CUDA_ATTN_FWD_MIX=1 / 0: three consumers' tiles of 64-row
    units that may mix heads, test_gpu_cuda_ws_forward_mixed_head_tiles): the consumer warpgroups taking turns at their softmaxes (the default
    at D = 64 without a causal mask, but for dropout under a key-only mask; PYKERNELS_CUDA_ATTN_FWD_SOFT_TURN=1 / 0
    forces it on / off), the async proxy's fence before each key block's products (off by default on TMA-loaded
    inputs; PYKERNELS_CUDA_ATTN_FWD_FENCE=1 puts it back), three consumer warpgroups on tiles of 192 rows instead
    of two on 128 (PYKERNELS_CUDA_ATTN_FWD_WG=3: D <= 64 without a mask on dense inputs; a warp's 16 rows and each
    row's key blocks are the same in both, and its consumers draw the dropout's keep bits that the producer draws for
    two), and three consumers' softmax beside their own previous P V (PYKERNELS_CUDA_ATTN_FWD_OVERLAP=1 / 0: O
    rescaled after that P V, the same products in the same order). O and the lse bitwise equal under each value, and
    the default equal to both, on dense inputs, GQA, key padding (with and without dropout), causal, D = 128, packed
    varlen sequences (tiles that one sequence's end leaves short, its last V block by cp.async) and lengths 1 and 17;
    two calls back to back (the turns' barriers balanced across calls: an unbalanced pair would hang or deadlock the
    second); then against the references."""
    q, k, v = _inputs((2, 4, 203, 64), (2, 2, 203, 64), (2, 2, 203, 64), dtype, "cuda", requires_grad=False)
    keys = torch.ones(2, 1, 1, 203, dtype=torch.bool, device="cuda")
    keys[1, ..., 150:] = False
    q128, k128, v128 = (torch.randn(2, 3, 300, 128, dtype=dtype, device="cuda") for _ in range(3))
    q1, k1, v1 = (torch.randn(2, 3, n, 64, dtype=dtype, device="cuda") for n in (17, 1, 1))
    lens = [5, 300, 129, 1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    qv, kv, vv = (torch.randn(sum(lens), 4, 64, dtype=dtype, device="cuda") for _ in range(3))

    calls = {
        "dense": lambda: _cuda_fwd(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)),
        "causal": lambda: _cuda_fwd(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal=True),
        "d128": lambda: _cuda_fwd(q128, k128, v128),
        "lengths 17 and 1": lambda: _cuda_fwd(q1, k1, v1),
        "gqa dropout": lambda: (sdpa(q, k, v, dropout_p=0.2, enable_gqa=True, backend="cuda"),),
        "key padding": lambda: (sdpa(q, k, v, keys, enable_gqa=True, backend="cuda"),),
        "key padding dropout": lambda: (sdpa(q, k, v, keys, dropout_p=0.2, enable_gqa=True, backend="cuda"),),
        "varlen": lambda: (varlen_attention(qv, kv, vv, cu, cu, max(lens), max(lens), backend="cuda"),),
    }
    _bitwise_across_env(monkeypatch, switch, (None, on, "0"), calls)
    _set_env(monkeypatch, switch, on)
    for args in ((q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)), (q1, k1, v1)):
        leaves = [t.detach().clone().requires_grad_(True) for t in args]
        _check_against_ref(*leaves, backend="cuda", what=switch)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("overlap", [None, "0", "1"], ids=["overlap_default", "overlap_off", "overlap_on"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_gpu_cuda_ws_forward_three_consumers(monkeypatch, dtype, overlap):
    """The warp-specialised forward with three consumer warpgroups (tiles of 192 query rows): by default at D <= 64
    without a mask, causal mask or dropout on dense inputs where their tiles do not pad the rows much more than two's
    (test_gpu_cuda_ws_forward_consumers_by_padding; 300 rows here), else two; PYKERNELS_CUDA_ATTN_FWD_WG=3 forces three
    wherever it applies (D <= 64, no mask, dense inputs: causal and dropout too), =2 two. Under =3, output and
    gradients against the float64 and same-dtype references at lengths whose last tile leaves one, two or all three
    warpgroups rows (1, 17, 100, 130, 203, 1000), D = 40, causal with Sq != Sk, GQA, and dropout (its keep mask
    pykernels.attention_dropout_mask's). ``overlap``: PYKERNELS_CUDA_ATTN_FWD_OVERLAP, whether a three-consumer
    kernel's softmax runs beside its own previous P V (the kernel's last template argument, true) or after it: by
    default without dropout, =1 always, =0 never."""
    _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_OVERLAP", overlap)
    if _sm90a_device():
        def nw(q, k, v, **kw):
            args = _ws_fwd_args(q, k, v, **kw)[0]  # (T, D, MODE, NW, kOvl, kMix)
            on = overlap == "1" or (overlap is None and not kw.get("dropout_p"))
            assert args[4] == ("true" if on and args[3] == "3" else "false"), (overlap, kw, args)
            return int(args[3])

        a = torch.randn(2, 3, 300, 64, dtype=dtype, device="cuda")
        a40 = a[..., :40]
        keys = torch.ones(2, 1, 1, 300, dtype=torch.bool, device="cuda")
        b = torch.randn(2, 3, 300, 128, dtype=dtype, device="cuda")
        for env, dense, causal, drop in ((None, 3, 2, 2), ("3", 3, 3, 3), ("2", 2, 2, 2)):
            _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_WG", env)
            assert nw(a, a, a) == dense and nw(a40, a40, a40) == dense, env
            assert nw(a, a, a, is_causal=True) == causal and nw(a, a, a, dropout_p=0.1) == drop, env
            assert nw(a, a, a, attn_mask=keys) == 2 and nw(b, b, b) == 2, env
    _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_WG", "3")
    for sq, sk, d, causal in ((1, 1, 64, False), (17, 17, 64, True), (100, 130, 64, False), (130, 100, 64, True),
                              (203, 203, 40, False), (1000, 1000, 64, True)):
        q, k, v = _inputs((2, 4, sq, d), (2, 2, sk, d), (2, 2, sk, d), dtype, "cuda")
        _check_against_ref(q, k, v, causal=causal, enable_gqa=True, backend="cuda",
                           what=f"three consumers {sq}x{sk} d{d} causal {causal}")
    q, k, v = _inputs((2, 4, 203, 64), (2, 4, 203, 64), (2, 4, 203, 64), dtype, "cuda")
    torch.manual_seed(6)
    seed = new_seed(q.device)
    torch.manual_seed(6)
    out = sdpa(q, k, v, dropout_p=0.2, backend="cuda")
    _check_against_ref(q, k, v, dropout_p=0.2, out=out, what="three consumers dropout",
                       dropout_mask=attention_dropout_mask(seed, 2, 4, 203, 203, 0.2, "cuda"))
    vl = torch.randint(1, 300, (4,)).tolist()
    cu = torch.tensor([0, *torch.tensor(vl).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    qv, kv, vv = (torch.randn(sum(vl), 4, 64, dtype=dtype, device="cuda") for _ in range(3))
    _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_WG", "2")
    two = varlen_attention(qv, kv, vv, cu, cu, max(vl), max(vl), backend="cuda")
    _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_WG", "3")
    assert torch.equal(varlen_attention(qv, kv, vv, cu, cu, max(vl), max(vl), backend="cuda"), two), "packed: two"


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_gpu_cuda_ws_forward_consumers_by_padding(monkeypatch, dtype):
    """Three consumers take tiles of 192 query rows, two of 128, unless the three's tiles are of 64-row units that may
    mix heads (kMix: csrc/attention.cuh, fwd_mix; by default where a head's 64-row units are at least 3 and no multiple
    of 3), which pad no head. By default three where they pad the sequence to at most 1.25x two's rows
    (fwd_three_pad_ok) or mix heads: two at 1..128 rows (192 rows against 128), three from 129 (129..192 three units
    a head, 193 and 256 mixing heads, 257 and 300 too, and 512). The kernel launched (its NW
    and kMix template arguments) at each length; the output and lse bitwise equal under the default, three forced
    without mixing (PYKERNELS_CUDA_ATTN_FWD_WG=3, PYKERNELS_CUDA_ATTN_FWD_MIX=0: the 192-row tiles) and two (a row's
    key blocks and arithmetic are the same in each kernel); output and gradients against the references, also with
    q / k / v as transformers' transposed views ((B, S, H, D) storage) and GQA."""
    if not _sm90a_device():
        pytest.skip("the warp-specialised forward runs on compute capability 9.0 from an sm_90a build")

    def nws(q, k, v, **kw):  # each launched kernel's NW
        return [int(args[3]) for args in _ws_fwd_args(q, k, v, **kw)]

    def mixes(q, k, v, **kw):  # each launched kernel's kMix
        return [args[5] == "true" for args in _ws_fwd_args(q, k, v, **kw)]

    def fwd(q, k, v):  # (the registered C++ op: output and lse)
        return torch.ops.pykernels_cuda.attention_fwd(q, k, v, None, None, None, q.shape[2], k.shape[2], 0.0, False,
                                                      q.shape[-1] ** -0.5)[:2]

    for sq, want, mix in ((1, 2, False), (64, 2, False), (100, 2, False), (128, 2, False), (129, 3, False),
                          (192, 3, False), (193, 3, True), (256, 3, True), (257, 3, True), (300, 3, True),
                          (512, 3, True)):
        for layout in ("bhsd", "bshd"):
            if layout == "bhsd":
                q, k, v = _inputs((2, 3, sq, 64), (2, 3, sq + 7, 64), (2, 3, sq + 7, 64), dtype, "cuda")
            else:  # (B, S, H, D) storage seen as (B, H, S, D)
                q, k, v = (torch.randn(2, n, 3, 64, dtype=dtype, device="cuda").transpose(1, 2).requires_grad_(True)
                           for n in (sq, sq + 7, sq + 7))
            _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_WG", None)
            assert nws(q, k, v) == [want] and mixes(q, k, v) == [mix], (sq, layout)
            o, lse = fwd(q.detach(), k.detach(), v.detach())
            for wg, no_mix in (("3", "0"), ("2", None)):
                _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_WG", wg)
                _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_MIX", no_mix)
                assert nws(q, k, v) == [int(wg)] and mixes(q, k, v) == [False], (sq, layout, wg)
                o3, lse3 = fwd(q.detach(), k.detach(), v.detach())
                assert torch.equal(o, o3) and torch.equal(lse, lse3), (sq, layout, wg)
            _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_WG", None)
            _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_MIX", None)
            if layout == "bshd" or sq in (128, 256, 512):
                _check_against_ref(q, k, v, backend="cuda", what=f"{sq} rows {layout}")
    q, k, v = _inputs((2, 6, 256, 40), (2, 2, 256, 40), (2, 2, 256, 40), dtype, "cuda")
    assert nws(q, k, v, enable_gqa=True) == [3] and mixes(q, k, v, enable_gqa=True) == [True]
    _check_against_ref(q, k, v, enable_gqa=True, backend="cuda", what="256 rows, GQA, d40")
    _check_against_ref(q, k, v, enable_gqa=True, backend="auto", what="256 rows, GQA, d40, auto (the Triton backward)")


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_gpu_cuda_ws_forward_mixed_head_tiles(monkeypatch, dtype):
    """The three-consumer forward's tiles of three 64-row units that may mix heads (kMix; csrc/fwd_order.cuh's
    mix_rows, test_attention_forward_mixed_head_tiles on the CPU): a tile meeting two heads streams their key blocks
    in turn and each warpgroup frees the other head's blocks unread. Output and lse bitwise equal with it forced on
    (PYKERNELS_CUDA_ATTN_FWD_MIX=1) and off (=0, the 192-row tiles), and the call repeated back to back (the ring's
    and the turns' barriers balanced across calls), at: every tile two heads (2 units a head: 100 and 128 rows), units
    past the last in the walk's last tile (1 x 1 x 100: one tile of [A, A, none]; 1 x 2 x 300), three units a head
    (130: no tile mixes, forced on), one key block and several (Sq != Sk: 300 x 77, 300 x 1000), more tiles than the
    grid (8 x 12 x 500: several rounds a block), GQA, D = 40, transformers' (B, S, H, D) storage; then output and
    gradients against the float64 and same-dtype references."""
    if not _sm90a_device():
        pytest.skip("the warp-specialised forward runs on compute capability 9.0 from an sm_90a build")
    _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_WG", "3")

    def fwd(q, k, v):  # (the registered C++ op: output and lse)
        return torch.ops.pykernels_cuda.attention_fwd(q, k, v, None, None, None, q.shape[2], k.shape[2], 0.0, False,
                                                      q.shape[-1] ** -0.5)[:2]

    cases = {"2 units a head": ((2, 3, 100, 64), (2, 3, 100, 64)), "128 rows": ((3, 5, 128, 64), (3, 5, 128, 64)),
             "one tile, a unit past the last": ((1, 1, 100, 64), (1, 1, 100, 64)),
             "units past the last": ((1, 2, 300, 64), (1, 2, 300, 64)),
             "three units a head": ((2, 3, 130, 64), (2, 3, 130, 64)),
             "one key block": ((2, 4, 300, 64), (2, 4, 77, 64)), "1000 keys": ((1, 5, 300, 64), (1, 5, 1000, 64)),
             "rounds": ((8, 12, 500, 64), (8, 12, 500, 64)), "gqa": ((2, 6, 200, 64), (2, 2, 200, 64)),
             "d40": ((3, 2, 450, 40), (3, 2, 450, 40))}
    for name, (shape_q, shape_k) in cases.items():
        q, k, v = _inputs(shape_q, shape_k, shape_k, dtype, "cuda", requires_grad=False)
        outs = {}
        for mix in ("1", "0"):
            _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_MIX", mix)
            args = _ws_fwd_args(q, k, v, enable_gqa=shape_q[1] != shape_k[1])
            assert [(a[3], a[4], a[5]) for a in args] == [("3", "true", "true" if mix == "1" else "false")], args
            outs[mix] = [fwd(q, k, v) for _ in range(2)]
        (o, lse), (o2, lse2) = outs["1"]
        assert not torch.isnan(o).any() and not torch.isnan(lse).any(), name
        for o3, lse3 in (outs["1"][1], *outs["0"]):
            assert torch.equal(o, o3) and torch.equal(lse, lse3), name
    _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_MIX", None)  # (300 rows: 5 units a head, mixed by default)
    q, k, v = (torch.randn(2, n, 4, 64, dtype=dtype, device="cuda").transpose(1, 2).requires_grad_(True)
               for n in (300, 200, 200))
    assert [a[5] for a in _ws_fwd_args(q, k, v)] == ["true"]
    _check_against_ref(q, k, v, backend="cuda", what="mixed heads, (B, S, H, D) storage")
    _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_MIX", "1")
    q, k, v = _inputs((2, 6, 100, 40), (2, 3, 100, 40), (2, 3, 100, 40), dtype, "cuda")
    assert [a[5] for a in _ws_fwd_args(q, k, v, enable_gqa=True)] == ["true"]
    _check_against_ref(q, k, v, enable_gqa=True, backend="cuda", what="mixed heads, 2 units a head, GQA, d40")


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("kernels", [None, "1", "0"], ids=["ws", "wgmma", "mma"])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_cuda_forward_lazy_max(monkeypatch, kernels, d):
    """The forwards' lazy max (a row's running max moves only where a key block's exceeds it by more than 2^8,
    FlashAttention-4's conditional rescaling): scores that climb along the keys by about 3 (in log2 units) a key block
    then fall (so the max moves every third block and stays stale between, its exponents up to about 2^8), with no
    mask (the raw-score softmax), causal, and the same climb through an additive mask; each kernel set
    (PYKERNELS_CUDA_ATTN_SM90 unset / 1 / 0): output and gradients against the float64 and bf16 references, and
    within those bounds of the max moved at every block (PYKERNELS_CUDA_ATTN_FWD_LAZY=0)."""
    _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_SM90", kernels)
    torch.manual_seed(3)
    b, h, s = 2, 3, 1000
    q, k, v = _inputs((b, h, s, d), (b, h, s, d), (b, h, s, d), BF16, "cuda", requires_grad=False)
    # a climb of 0.017 a key (natural log: 128 keys 3.1 in log2 units) to the middle, then down
    ramp = 0.017 * torch.minimum(torch.arange(s), s - torch.arange(s)).to(torch.float32).cuda()
    q[..., 0] = 1.0
    k[..., 0] = (ramp * math.sqrt(d)).to(BF16)  # (q . k) / sqrt(d) = ramp + the other dims' noise
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    qm, km = q.detach().clone().requires_grad_(), torch.randn_like(k).requires_grad_()
    addend = ramp.view(1, 1, 1, s).expand(b, 1, 1, s).to(BF16)
    cases = {"raw": dict(inputs=(q, k, v)), "causal": dict(inputs=(q, k, v), causal=True),
             "additive": dict(inputs=(qm, km, v), mask=addend)}
    for name, c in cases.items():
        outs = []
        for lazy in (None, "0"):
            _set_env(monkeypatch, "PYKERNELS_CUDA_ATTN_FWD_LAZY", lazy)
            out, _ = _check_against_ref(*c["inputs"], mask=c.get("mask"), causal=c.get("causal", False),
                                        backend="cuda", what=f"{name} lazy={lazy}")
            outs.append(out.detach().float())
        assert not outs[0].isnan().any(), name
        torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_cuda_varlen_dropout_fused_backward_is_tritons_mask(d):
    """The varlen fused backward (D = 64, and D = 128's deferred kernel; TMA over the packed rows) with dropout draws the
    forward's mask: outputs and gradients equal the Triton backend's for the same torch seed, with NaN past
    cu_seqlens[-1]; the fused kernel ran."""
    lengths = [200, 77, 0, 333, 5]
    q, k, v, cu = _varlen_poisoned(lengths, 4, 4, d, 3, "cuda")
    call = lambda backend: varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), dropout_p=0.15,  # noqa: E731
                                            backend=backend)
    if _sm90a_device():
        names = _fused_bwd_kernels(lambda: call("cuda"))
        kernel = ", true, 3>" if d == 64 else ", true, 4>"
        assert any(kernel in n for n in names) and any("attn_dq_convert" in n for n in names), names
    runs = []
    for backend in ("cuda", "triton"):
        torch.manual_seed(11)
        out = call(backend)
        do = torch.ones_like(out)
        runs.append((out[:int(cu[-1])], *(g[:int(cu[-1])] for g in _grads(out, (q, k, v), do))))
    for a, b in zip(*runs):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_cuda_fused_backward_cp_async_dense(monkeypatch):
    """Dense inputs TMA cannot take (K and V of stride 0 over the batch) can run the fused backward at D = 64 with
    cp.async loads (with dropout; here without, PYKERNELS_CUDA_ATTN_FUSED_DQ=1): output and gradients against the
    reference, and that kernel is the one that ran."""
    monkeypatch.setenv("PYKERNELS_CUDA_ATTN_FUSED_DQ", "1")
    q = torch.randn(3, 4, 150, 64, device="cuda", dtype=BF16, requires_grad=True)
    k0, v0 = (torch.randn(1, 4, 150, 64, device="cuda", dtype=BF16) for _ in range(2))
    k, v = (t.expand(3, 4, 150, 64).requires_grad_(True) for t in (k0, v0))
    out = sdpa(q, k, v, is_causal=True, backend="cuda")
    _check_against_ref(q, k, v, causal=True, out=out)
    if _sm90a_device():
        names = _fused_bwd_kernels(lambda: sdpa(q, k, v, is_causal=True, backend="cuda"))
        assert any(", false, 1>" in n for n in names) and any("attn_dq_convert" in n for n in names), names


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_cuda_backend_int64_offsets():
    """More than 2**31 elements per tensor: the C++ kernels' offsets are int64. Checks the last batches."""
    b, h, s, d = 8192, 16, 136, 128  # 2.28e9 elements per tensor (4.6 GB in bf16)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=BF16).requires_grad_(True) for _ in range(3))
    out = sdpa(q, k, v, is_causal=True, backend="cuda")
    do = torch.randn_like(out)
    dq, dk, dv = _grads(out, (q, k, v), do)
    tail = slice(b - 2, b)

    def ref(dt):
        qq, kk, vv = (t.detach()[tail].to(dt).requires_grad_(True) for t in (q, k, v))
        o = attention_reference(qq, kk, vv, is_causal=True)
        return (o, *_grads(o, (qq, kk, vv), do[tail].to(dt)))

    for name, a, hi, lo in zip(("out", "dq", "dk", "dv"), (out[tail], dq[tail], dk[tail], dv[tail]),
                               ref(torch.float64), ref(BF16)):
        assert_close_to_ref(name, a, hi, lo)


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_cuda_backend_routing():
    q, k, v = _inputs((2, 4, 64, 64), (2, 4, 64, 64), (2, 4, 64, 64), BF16, "cuda")
    # auto keeps Triton; named, the C++ op (its autograd node is C++'s)
    assert "AttentionFunction" not in sdpa(q, k, v).grad_fn.name()
    assert "AttentionFunction" in sdpa(q, k, v, backend="cuda").grad_fn.name()
    with pykernels.use_backend("cuda"):
        assert "AttentionFunction" in sdpa(q, k, v).grad_fn.name()
    for dt, d, dv, why in ((F32, 64, 64, "float32"), (BF16, 72, 64, "value head dim"), (BF16, 36, 36, "head dim 36")):
        qq, kk, vv = _inputs((1, 2, 8, d), (1, 2, 8, d), (1, 2, 8, dv), dt, "cuda")
        with pytest.raises(BackendUnavailableError, match=why):
            sdpa(qq, kk, vv, backend="cuda")
    # under torch.compile too (the compiled pair: test_gpu_compile_runs_the_cuda_pair), and what it does not cover
    # raises there as well
    with pytest.raises(BackendUnavailableError, match="float32"):
        torch.compile(lambda x: sdpa(x, k.float(), v.float(), backend="cuda"))(q.float())


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_compile_runs_the_cuda_pair():
    """Under torch.compile the C++ kernels run through their compiled pair (pykernels_cuda::attention_fwd and
    attention_bwd, which the graph calls with no Python between) where an eager call would take the C++ op: auto with
    dropout (dense with a key-padding mask, GQA and transformers' (B, S, H, D) storage; varlen with an empty
    sequence), and named without dropout. The generated code holds the pair and no Triton custom op, and outputs and
    gradients equal the eager C++ op's bit for bit (dQ of the fused backward within a rounding, bitwise with
    deterministic=True; the forward draws the seed as the eager op does: one
    torch.manual_seed, one dropout mask). Without dropout, auto stays on Triton under compile as eagerly."""
    from torch._inductor.utils import run_and_get_code
    b, s, hq, hkv, d = 2, 200, 4, 2, 64

    def bshd(h):  # (B, H, S, D) views of (B, S, H, D) storage
        return torch.randn(b, s, h, d, dtype=BF16, device="cuda").transpose(1, 2).detach().requires_grad_()

    q, k, v = bshd(hq), bshd(hkv), bshd(hkv)
    mask = torch.rand(b, 1, 1, s, device="cuda") > 0.2
    lq = [150, 0, 37]
    qv, kv, vv, cu_q, cu_k = _varlen_case(lq, lq, hq, hkv, 96, BF16, "cuda")

    def dense_dropout(q, k, v, backend):
        return sdpa(q, k, v, mask, dropout_p=0.1, enable_gqa=True, backend=backend)

    def dense_dropout_det(q, k, v, backend):  # (the pair: no atomics)
        return sdpa(q, k, v, mask, dropout_p=0.1, enable_gqa=True, backend=backend, deterministic=True)

    def causal(q, k, v, backend):
        return sdpa(q, k, v, is_causal=True, enable_gqa=True, backend=backend)

    def varlen(q, k, v, backend):
        return varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lq), causal=True, dropout_p=0.1, backend=backend)

    cases = (("dense dropout", dense_dropout, (q, k, v), None), ("dense dropout det", dense_dropout_det, (q, k, v), None),
             ("causal", causal, (q, k, v), "cuda"), ("varlen", varlen, (qv, kv, vv), None))
    for name, f, inputs, backend in cases:
        do = torch.randn_like(f(*inputs, "cuda"))

        def run(fn):
            torch.manual_seed(5)
            out = fn(*inputs)
            return [out.detach(), *_grads(out, inputs, do)]

        torch._dynamo.reset()
        compiled = torch.compile(lambda *a: f(*a, backend), fullgraph=True)
        _, code = run_and_get_code(run, compiled)
        code = "\n".join(code)
        assert "pykernels_cuda.attention_fwd" in code and "pykernels_cuda.attention_bwd" in code, name
        assert "torch.ops.pykernels." not in code, name
        got, want = run(compiled), run(lambda *a: f(*a, "cuda"))
        for i, (g, e) in enumerate(zip(got, want)):
            assert g.shape == e.shape, (name, i)
            if name in ("dense dropout", "causal") and i == 1 and _sm90a_device():
                # dQ of the fused backward (Hopper, D <= 64 with or without dropout, D <= 128 with): its reductions add
                # in no fixed order, so within a rounding; bitwise under deterministic=True (the next case)
                torch.testing.assert_close(g, e, rtol=1e-2, atol=1e-2 * e.abs().max().item())
            else:
                assert torch.equal(g, e), (name, i)
        assert got[0].stride() == want[0].stride(), name  # (the fake's strides are the op's)
    torch._dynamo.reset()
    _, code = run_and_get_code(lambda: torch.compile(lambda *a: causal(*a, None), fullgraph=True)(q, k, v))
    assert "pykernels_cuda" not in "\n".join(code)


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_auto_takes_cuda_for_eager_dropout(monkeypatch):
    """auto: eager calls with dropout run the C++ op (lane and full path, dense and varlen), the same mask as the
    Triton backend's; without dropout, under use_backend("triton") or with AUTO_CUDA_DROPOUT off, Triton."""
    import pykernels.attention as pa
    q, k, v = _inputs((2, 4, 64, 64), (2, 2, 64, 64), (2, 2, 64, 64), BF16, "cuda")
    mask = torch.rand(2, 1, 1, 64, device="cuda") > 0.2
    for lane in (True, False):
        monkeypatch.setattr(pa, "_LANE_ON", lane)
        for m in (None, mask):
            torch.manual_seed(3)
            out = sdpa(q, k, v, m, dropout_p=0.1)
            assert "AttentionFunction" in out.grad_fn.name(), (lane, m is None)
            torch.manual_seed(3)
            ref = sdpa(q, k, v, m, dropout_p=0.1, backend="triton")
            torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
            assert "AttentionFunction" not in sdpa(q, k, v, m).grad_fn.name()
            with pykernels.use_backend("triton"):
                assert "AttentionFunction" not in sdpa(q, k, v, m, dropout_p=0.1).grad_fn.name()
        lq = [40, 0, 17]
        qv, kv, vv, cu_q, cu_k = _varlen_case(lq, lq, 4, 2, 64, BF16, "cuda")
        out = varlen_attention(qv, kv, vv, cu_q, cu_k, 40, 40, dropout_p=0.1, causal=True)
        assert "AttentionFunction" in out.grad_fn.name(), lane
        assert "AttentionFunction" not in varlen_attention(qv, kv, vv, cu_q, cu_k, 40, 40).grad_fn.name()
    monkeypatch.setattr(pa, "AUTO_CUDA_DROPOUT", False)
    pa._LANE_CUDA.clear()
    for lane in (True, False):
        monkeypatch.setattr(pa, "_LANE_ON", lane)
        assert "AttentionFunction" not in sdpa(q, k, v, dropout_p=0.1).grad_fn.name()


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_auto_takes_cuda_forward_at_bert_shapes(monkeypatch):
    """auto without dropout, on Hopper with the sm_90a build: at D <= 64, not causal, with no mask or a boolean
    key-padding mask, the forward kernel is the C++ one and the backward the Triton backend's, on the C++ forward's
    output and lse (and the Triton kernel's key ranges); the pair's output and gradients against the references (the
    lane and the full path, GQA, Sq != Sk, lengths 1, 17 and 1000, D = 40, a batch whose keys are all masked: output
    and gradients 0, never NaN; under torch.compile). A causal mask, an additive or a (B, 1, Sq, Sk) mask, D = 128,
    backend "triton" or AUTO_CUDA_FWD off: the Triton forward (with dropout auto takes the C++ op, both ways). Unmasked
    from 512 keys at D = 64 the C++ forward only where its rounds win (BERT-base yes, BERT-large no on 132 SMs). Without
    sm_90a code or on another device: never the C++."""
    import pykernels.attention as pa
    from torch.profiler import ProfilerActivity, profile

    def names(fn):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events()]

    def cuda_fwd(q, k, v, **kw):
        """Whether a forward+backward ran the C++ forward kernel (and never a C++ backward kernel)."""
        def step():
            out = sdpa(q, k, v, **kw)
            torch.autograd.grad(out, [q, k, v], torch.ones_like(out))
        ns = names(step)
        assert not any("pykernels::attn::attn_bwd" in n for n in ns), ns
        return any("attn_fwd_sm90_ws_kernel" in n for n in ns)

    want = _sm90a_device()
    q, k, v = _inputs((2, 4, 300, 64), (2, 2, 300, 64), (2, 2, 300, 64), BF16, "cuda")
    b = _inputs((2, 2, 300, 128), (2, 2, 300, 128), (2, 2, 300, 128), BF16, "cuda")
    keys = torch.rand(2, 1, 1, 300, device="cuda") > 0.2
    for lane in (True, False):
        monkeypatch.setattr(pa, "_LANE_ON", lane)
        assert cuda_fwd(q, k, v, enable_gqa=True) == want, lane
        assert not cuda_fwd(q, k, v, is_causal=True, enable_gqa=True), lane
        assert cuda_fwd(q, k, v, attn_mask=keys, enable_gqa=True) == want, lane
        additive = torch.zeros(keys.shape, dtype=BF16, device="cuda").masked_fill(~keys, float("-inf"))
        assert not cuda_fwd(q, k, v, attn_mask=additive, enable_gqa=True), lane
        assert not cuda_fwd(q, k, v, attn_mask=torch.rand(2, 1, 300, 300, device="cuda") > 0.2, enable_gqa=True), lane
        assert not cuda_fwd(*b), lane
        with pykernels.use_backend("triton"):
            assert not cuda_fwd(q, k, v, enable_gqa=True), lane
        for sq, sk, d in ((1, 1, 64), (17, 17, 64), (100, 130, 64), (1000, 1000, 64), (203, 203, 40)):
            args = _inputs((2, 4, sq, d), (2, 2, sk, d), (2, 2, sk, d), BF16, "cuda")
            _check_against_ref(*args, enable_gqa=True, backend="auto", what=f"auto {sq}x{sk} d{d} lane {lane}")
        for sk in (17, 300):  # key padding, batch 1's keys all masked (batch 0's from 1 to sk - 1 valid)
            args = _inputs((2, 4, 130, 64), (2, 2, sk, 64), (2, 2, sk, 64), BF16, "cuda")
            pad = (torch.arange(sk, device="cuda") < torch.tensor([[sk - 1], [0]], device="cuda")).view(2, 1, 1, sk)
            pad[0, ..., 0] = False
            assert cuda_fwd(*args, attn_mask=pad, enable_gqa=True) == want, (lane, sk)
            out, g = _check_against_ref(*args, mask=pad, enable_gqa=True, backend="auto",
                                        what=f"auto key padding 130x{sk} lane {lane}")
            assert out[1].abs().max() == 0 and all(t[1].abs().max() == 0 for t in g), (lane, sk)
    # unmasked at D = 64 from 512 keys, where the Gluon forward would run: the C++ one only where its rounds over the
    # SMs do not lose (``_cpp_fwd_rounds_win``: BERT-base's shape takes it, BERT-large's not, on 132 SMs)
    from pykernels._kernels.attention_sm90 import _num_sms
    for shape in ((32, 12, 512, 64), (16, 16, 512, 64)):
        big = _inputs(shape, shape, shape, BF16, "cuda")
        rounds = pa._cpp_fwd_rounds_win(*shape[:3], _num_sms(big[0].device)) if want else False
        assert cuda_fwd(*big) == rounds, shape
    compiled = torch.compile(lambda *a: sdpa(*a, enable_gqa=True), fullgraph=True)
    qc, kc, vc = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = compiled(qc, kc, vc)
    ref = sdpa(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)  # (the same kernels: bitwise)
    monkeypatch.setattr(pa, "AUTO_CUDA_FWD", False)
    pa._LANE_CUDA_FWD.clear()
    for lane in (True, False):
        monkeypatch.setattr(pa, "_LANE_ON", lane)
        assert not cuda_fwd(q, k, v, enable_gqa=True), lane


def test_auto_cuda_head_dim_rule(monkeypatch):
    """auto without dropout takes the C++ op on Hopper at the head dims Triton has no Hopper kernel for: 64 < D < 128
    (not above 128, where the Triton D = 256 tiles are the faster); no mask or a boolean key-padding one; dense calls
    (not varlen), not with backend "triton", not with AUTO_CUDA_HEAD_DIMS off. The rule's parts on CPU tensors, the C++ op's Hopper
    check stubbed (what the GPU test below runs for real)."""
    import pykernels.attention as pa
    monkeypatch.setattr(pa, "_hopper_cpp_kernels", lambda q, k, v, mask: True)

    def qkv(d, grad=False):
        return _inputs((2, 4, 33, d), (2, 2, 33, d), (2, 2, 33, d), F16, "cpu", requires_grad=grad)

    for d, want in ((32, False), (64, False), (72, True), (80, True), (96, True), (120, True), (128, False),
                    (160, False), (192, False), (256, False)):
        assert pa._auto_cuda_head_dim_kind(*qkv(d), None) == want, d
    q, k, v = qkv(80)
    keys = (torch.rand(2, 1, 1, 33) > 0.3).expand(2, 4, 33, 33)
    assert pa._auto_cuda_head_dim_kind(q, k, v, keys)
    assert not pa._auto_cuda_head_dim_kind(q, k, v, torch.zeros(2, 4, 33, 33, dtype=F16))  # additive
    assert not pa._auto_cuda_head_dim_kind(q, k, v, (torch.rand(2, 1, 33, 33) > 0.3).expand(2, 4, 33, 33))
    assert pa._auto_cuda_head_dim_kind(*qkv(80, grad=True), None)
    with torch.no_grad():
        assert pa._auto_cuda_head_dim_kind(*qkv(96, grad=True), None)
    # unmasked D = 80 / 96 where the Gluon kernels take both directions on their D = 128 tiles: not the C++ op (the
    # Gluon rules stubbed: ``test_gpu_sm90_zero_fill_d80_d96`` runs them)
    from pykernels._kernels import attention as katt
    monkeypatch.setattr(katt, "sm90_forward", lambda *a, **kw: True)
    for bwd, want in (("fused", False), ("dkdv", False), ("", True)):  # ("": too few CTAs for the Gluon backward)
        monkeypatch.setattr(katt, "sm90_backward", lambda *a, _b=bwd, **kw: _b)
        assert pa._auto_cuda_head_dim_kind(*qkv(96), None) == want, bwd
        assert pa._auto_cuda_head_dim_kind(*qkv(80), None) == want, bwd
        assert pa._auto_cuda_head_dim_kind(*qkv(72), None)  # (no tiles take 72)
        assert pa._auto_cuda_head_dim_kind(q, k, v, keys)  # key padding: the C++ op (its backward takes the mask)
    monkeypatch.setattr(katt, "sm90_forward", lambda *a, **kw: False)
    # _use_cuda hands the rule to use_cuda_op as ``auto``: dense calls without dropout under auto only
    seen = []
    monkeypatch.setattr(pa, "use_cuda_op", lambda op, backend, device, cover, *, auto, traced, capture:
                        seen.append(auto) or False)
    q, k, v = qkv(96)
    for backend, causal, p, want in ((None, False, 0.0, True), ("auto", True, 0.0, True), ("triton", False, 0.0,
                                     False), (None, None, 0.0, False), (None, False, 0.1, pa.AUTO_CUDA_DROPOUT)):
        seen.clear()
        pa._use_cuda(pa._OP, backend, q, k, v, None, 2, p, causal)
        assert seen == [want], (backend, causal, p)
    monkeypatch.setattr(pa, "AUTO_CUDA_HEAD_DIMS", False)
    assert not pa._auto_cuda_head_dim_kind(q, k, v, None)


def test_auto_cuda_forward_rounds_rule(monkeypatch):
    """auto's C++ forward at D = 64 without a mask, where the Gluon forward would run (from 512 keys): only where the
    C++ kernel's rounds of three-unit tiles over the SMs take no longer than the Gluon kernel's two-unit tiles at the
    measured speed a unit (``_cpp_fwd_rounds_win``). The twelve shapes H200 run477 measured on 132 SMs, each on the
    side it measured faster; BERT-large (16 x 16 x 512) takes the Gluon forward, BERT-base the C++ one; with a key-padding
    mask, under 512 keys, below D = 64 or with the Gluon forward off, the C++ forward as before. The rule's parts on
    meta tensors, the C++ op's Hopper check stubbed and the SM count 132 (the GPU test above runs the kernels)."""
    import pykernels.attention as pa
    from pykernels._kernels import attention_sm90 as a9
    faster = {(32, 12, 512): 1.057, (16, 16, 512): 0.949, (16, 12, 512): 1.064, (24, 16, 512): 1.055,
              (32, 16, 512): 1.031, (64, 12, 512): 1.057, (8, 16, 512): 0.985, (48, 16, 512): 1.062,
              (8, 12, 1024): 1.088, (8, 16, 1024): 0.973, (16, 16, 1024): 1.095, (4, 16, 2048): 0.970}
    for (b, h, s), cpp_over_gluon in faster.items():
        assert pa._cpp_fwd_rounds_win(b, h, s, 132) == (cpp_over_gluon > 1), (b, h, s)
    assert not pa._cpp_fwd_rounds_win(1, 1, 512, 132)  # one tile: the Gluon kernel's two units take less time
    assert not pa._cpp_fwd_rounds_win(64, 12, 128, 132)  # two consumers (three would pad 128 rows to 192)
    monkeypatch.setattr(pa, "_hopper_cpp_kernels", lambda q, k, v, mask: True)
    monkeypatch.setattr(a9, "_num_sms", lambda device: 132)

    def kind(b, h, s, d=64, mask=None, causal=False):
        q, k, v = (torch.empty(b, h, s, d, dtype=BF16, device="meta") for _ in range(3))
        return pa._auto_cuda_fwd_kind(q, k, v, mask, causal, "auto")

    pad = torch.ones(16, 1, 1, 512, dtype=torch.bool, device="meta")
    assert kind(32, 12, 512) and not kind(16, 16, 512) and kind(16, 16, 512, mask=pad) and kind(16, 16, 256)
    assert not kind(8, 16, 1024) and kind(16, 16, 1024) and kind(16, 16, 512, d=32) and not kind(32, 12, 512, causal=True)
    q, k, v = (torch.empty(16, 16, 512, 80, dtype=BF16, device="meta")[..., :64] for _ in range(3))
    assert not pa._auto_cuda_fwd_kind(q, k, v, None, False, "auto")  # padded rows: host descriptors still
    q = torch.empty(16, 512, 16, 64, dtype=BF16, device="meta").transpose(1, 2)  # transformers' layout
    assert not pa._auto_cuda_fwd_kind(q, q, q, None, False, "auto")
    q = torch.empty(16, 16, 40, 64, dtype=BF16, device="meta")  # 40 query rows: below a 64-row Q tile
    assert pa._auto_cuda_fwd_kind(q, k, v, None, False, "auto")  # (the Gluon forward makes its descriptors)
    monkeypatch.setenv("PYKERNELS_ATTN_SM90", "0")  # no Gluon forward: the C++ one beats Triton's
    assert kind(16, 16, 512)


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_auto_takes_cuda_op_at_head_dims_80_96(monkeypatch):
    """auto without dropout on Hopper with the sm_90a build: at D = 80 and 96 (bidirectional, causal, key padding,
    GQA, odd lengths) the C++ op runs forward and backward; at D = 64 / 128 / 192 / 256, with an additive mask,
    backend "triton" or AUTO_CUDA_HEAD_DIMS off, never the C++ op. Outputs and gradients against the references
    (the lane and the full path)."""
    import pykernels.attention as pa
    from torch.profiler import ProfilerActivity, profile

    def cpp_kernels(q, k, v, backward=True, **kw):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = sdpa(q, k, v, **kw)
            if backward:
                torch.autograd.grad(out, [q, k, v], torch.ones_like(out))
            torch.cuda.synchronize()
        return sorted({e.name.split("<")[0].split("(")[0] for e in prof.events() if "pykernels::attn::" in e.name})

    from pykernels._kernels import attention_sm90 as a9
    monkeypatch.setattr(a9, "D80_96", False)  # (on: the Gluon kernels, test_gpu_sm90_zero_fill_d80_d96)
    want = _sm90a_device()
    for lane in (True, False):
        monkeypatch.setattr(pa, "_LANE_ON", lane)
        for d in (80, 96):
            q, k, v = _inputs((2, 4, 300, d), (2, 2, 300, d), (2, 2, 300, d), BF16, "cuda")
            ran = cpp_kernels(q, k, v, enable_gqa=True)
            assert bool(ran) == want and (not want or any("attn_bwd" in n for n in ran)), (lane, d, ran)
            assert bool(cpp_kernels(q, k, v, is_causal=True, enable_gqa=True)) == want, (lane, d)
            keys = torch.rand(2, 1, 1, 300, device="cuda") > 0.2
            assert bool(cpp_kernels(q, k, v, attn_mask=keys, enable_gqa=True)) == want, (lane, d)
            additive = torch.zeros(keys.shape, dtype=BF16, device="cuda").masked_fill(~keys, float("-inf"))
            assert not cpp_kernels(q, k, v, attn_mask=additive, enable_gqa=True), (lane, d)
            with pykernels.use_backend("triton"):
                assert not cpp_kernels(q, k, v, enable_gqa=True), (lane, d)
            for sq, sk, causal in ((1, 1, False), (17, 17, True), (100, 130, False), (1000, 1000, True)):
                args = _inputs((2, 4, sq, d), (2, 2, sk, d), (2, 2, sk, d), BF16, "cuda")
                _check_against_ref(*args, causal=causal, enable_gqa=True, backend="auto",
                                   what=f"auto {sq}x{sk} d{d} causal {causal} lane {lane}")
            pad = (torch.arange(130, device="cuda") < torch.tensor([[129], [0]], device="cuda")).view(2, 1, 1, 130)
            args = _inputs((2, 4, 77, d), (2, 2, 130, d), (2, 2, 130, d), BF16, "cuda")
            out, g = _check_against_ref(*args, mask=pad, enable_gqa=True, backend="auto",
                                        what=f"auto key padding d{d} lane {lane}")
            assert out[1].abs().max() == 0 and all(t[1].abs().max() == 0 for t in g), (lane, d)
        for d in (192, 256):
            q, k, v = _inputs((2, 2, 260, d), (2, 2, 260, d), (2, 2, 260, d), BF16, "cuda")
            assert not cpp_kernels(q, k, v, is_causal=True), (lane, d)
            _check_against_ref(q, k, v, causal=True, backend="auto", what=f"auto d{d} lane {lane}")
        for d in (64, 128):
            assert not any("attn_bwd" in n for n in cpp_kernels(*_inputs(*[(2, 2, 300, d)] * 3, BF16, "cuda"))), d
    # D80_96 on (the default): unmasked calls leave the C++ op only where the Gluon backward's rule takes the shape
    # too (``_auto_cuda_head_dim_kind``): a small call keeps it, the matrix's 8 x 16 x 2048 runs the Gluon kernels
    from pykernels._kernels import attention as katt
    monkeypatch.setattr(a9, "D80_96", True)
    pa._LANE_CUDA_HEAD_DIM.clear()
    for lane in (True, False):
        monkeypatch.setattr(pa, "_LANE_ON", lane)
        for d in (80, 96):
            small = _inputs((2, 4, 320, d), (2, 2, 320, d), (2, 2, 320, d), BF16, "cuda")
            assert not katt.sm90_backward(*small, small[0], None, dropout_p=0.0, scale=d ** -0.5)
            assert bool(cpp_kernels(*small, enable_gqa=True)) == want, (lane, d)
            big = _inputs(*[(8, 16, 2048, d)] * 3, BF16, "cuda")
            assert katt.sm90_backward(*big, big[0], None, dropout_p=0.0, scale=d ** -0.5)
            assert not cpp_kernels(*big), (lane, d)
            keys = torch.rand(8, 1, 1, 2048, device="cuda") > 0.2
            assert bool(cpp_kernels(*big, attn_mask=keys)) == want, (lane, d)  # key padding keeps the C++ op
    pa._LANE_CUDA_HEAD_DIM.clear()
    monkeypatch.setattr(pa, "AUTO_CUDA_HEAD_DIMS", False)
    pa._LANE_CUDA_HEAD_DIM.clear()
    for lane in (True, False):
        monkeypatch.setattr(pa, "_LANE_ON", lane)
        assert not cpp_kernels(*_inputs(*[(2, 2, 300, 96)] * 3, BF16, "cuda")), lane
    pa._LANE_CUDA_HEAD_DIM.clear()


def test_compiled_pair_fakes_promise_the_cpp_layouts():
    # the fake impls of the C++ attention pair (pykernels/_cuda_ops.py) promise torch.compile the strides the C++ op
    # returns (csrc/attention.cpp: ``aligned`` keeps a tensor whose last dim is contiguous and whose start and strides
    # are 16-byte multiples, else copies it contiguous; outputs are ``empty_like`` of that); inductor asserts them
    from pykernels._cuda_ops import _aligned_like, _attention_bwd, _attention_fwd
    base = torch.randn(2, 17, 4, 64, dtype=F16)
    q = base.transpose(1, 2)  # transformers' layout: kept
    assert _aligned_like(q).stride() == q.stride()
    n = 2 * 4 * 17 * 64
    flat = torch.randn(n + 8, dtype=F16)
    shifted = flat[1:n + 1].view(2, 17, 4, 64).transpose(1, 2)  # that layout at a 2-byte offset: copied, contiguous
    assert _aligned_like(shifted).stride() == (4 * 17 * 64, 17 * 64, 64, 1)
    assert _aligned_like(flat[8:].view(2, 17, 4, 64).transpose(1, 2)).stride() == q.stride()  # 16 bytes: kept
    odd = torch.randn(2, 4, 17, 68, dtype=F16)[..., :64]  # rows of 136 bytes: copied
    assert _aligned_like(odd).is_contiguous()
    kv = torch.randn(1, 2, 17, 64, dtype=F16).expand(3, 2, 17, 64)  # stride-0 batch: kept, empty_like is dense
    assert _aligned_like(kv).is_contiguous() and _aligned_like(kv).shape == kv.shape
    o, lse, seed = _attention_fwd(q, q, q, None, None, None, 0, 0, 0.1, False, 0.125)
    assert o.stride() == q.stride() and lse.shape == (2, 4, 17) and lse.dtype == torch.float32
    assert seed.shape == (1,) and seed.device == q.device and seed.dtype == torch.int64
    assert _attention_fwd(q, q, q, None, None, None, 0, 0, 0.0, False, 0.125)[2].numel() == 0  # no CPU tensor
    dq, dk, dv = _attention_bwd(o, q, kv, kv, o, lse, None, None, None, 0, 0, 0.0, False, 0.125, seed)
    assert dq.stride() == q.stride() and dk.is_contiguous() and dv.shape == kv.shape
    t = torch.randn(30, 4, 64, dtype=F16)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    o, lse, _ = _attention_fwd(t, t, t, None, cu, cu, 20, 20, 0.0, True, 0.125)
    assert o.is_contiguous() and lse.shape == (4, 30)


def test_cuda_cover_rules(device):
    """The C++ op's cover on any machine, and that without dropout nothing but naming it routes a call there."""
    from pykernels.attention import _cuda_cover, _use_cuda
    q, k, v = _inputs((1, 2, 8, 64), (1, 2, 8, 64), (1, 2, 8, 64), F16, device, requires_grad=False)
    assert _cuda_cover(q, k, v, None, 1) is None
    assert _cuda_cover(q, k, v, torch.ones(1, 2, 8, 8, dtype=torch.bool, device=device), 1) is None
    assert "float32" in _cuda_cover(q.float(), k.float(), v.float(), None, 1)
    assert "head dim 20" in _cuda_cover(q[..., :20], k[..., :20], v[..., :20], None, 1)
    assert "value head dim" in _cuda_cover(q, k, v[..., :32], None, 1)
    assert "65535" in _cuda_cover(q, k, v, None, 70000)
    assert "int32" in _cuda_cover(q, k, v, torch.ones(1, 2, 8, 8, dtype=torch.int32, device=device), 1)
    for backend in (None, "auto", "triton", "reference"):
        assert not _use_cuda("scaled_dot_product_attention", backend, q, k, v, None, 1, 0.0)
    for backend in ("triton", "reference"):  # (with dropout auto may take it: test_gpu_auto_takes_cuda_for_eager_dropout)
        assert not _use_cuda("scaled_dot_product_attention", backend, q, k, v, None, 1, 0.1)
    if device.type == "cpu":
        assert not _use_cuda("scaled_dot_product_attention", "auto", q, k, v, None, 1, 0.1)
    if not pykernels.backends()["cuda"].available:
        with pytest.raises(BackendUnavailableError, match="pykernels._C is not built"):
            sdpa(q, k, v, backend="cuda")
        cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
        with pytest.raises(BackendUnavailableError, match="pykernels._C is not built"):
            varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 8, 8,
                             backend="cuda")


def test_dropout_tables_pick_ptx_entries():
    """The dK/dV and dQ kernels' tables with dropout: each entry is one of the kernel's main table (the autotuner's
    configs list holds only those), and the pruner takes the PTX table where the kernel draws by PTX."""
    import triton

    from pykernels._kernels import attention as tri
    for kind in ("dq", "dkdv"):
        main = {e for t in tri._TABLE[kind].values() for e in t}
        for variant in ("_dropout", "_dropout_ptx"):
            for tier, entries in tri._TABLE[kind + variant].items():
                assert set(entries) <= main, (kind, variant, tier)
        configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                   for bm, bn, w, st in dict.fromkeys(e for t in tri._TABLE[kind].values() for e in t)]
        for ptx in (False, True):
            for tier in (64, 128):
                args = dict(BLOCK_D=tier, BLOCK_DV=tier, HAS_DROPOUT=True, PTX_DROPOUT=ptx, PRECISION="tf32",
                            seq_bucket=512)
                kept = tri._pruner(kind)(configs, {"seq_bucket": 512}, **args)
                want = tri._TABLE[kind + ("_dropout_ptx" if ptx else "_dropout")][tier]
                got = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept]
                assert got == want, (kind, ptx, tier)  # (in table order: PYKERNELS_AUTOTUNE=0 keeps the first)


def test_sm90_forward_q_buffers_fit_shared_memory():
    """The sm_90 Gluon forward keeps two Q tiles a warpgroup (the next tile's Q arrives during the epilogue) only where
    they fit beside the K/V ring in 227 KiB; each head dim's config fits with its ``q_bufs``."""
    from pykernels._kernels import attention_sm90 as a9
    assert a9.q_bufs(64, 128, 2, 64) == 2 and a9.q_bufs(64, 128, 2, 128) == 2
    assert a9.q_bufs(64, 64, 2, 256) == 1   # 128 KiB of Q tiles beside 128 KiB of K / V: one Q tile a warpgroup
    assert a9.q_bufs(64, 32, 3, 256) == 2   # 128 + 96 KiB + the mbarriers fit
    assert a9.q_bufs(64, 32, 4, 256) == 1
    for d, (bm, bn, stages) in list(a9.CONFIGS.items()) + list(a9.KEY_PAD_CONFIGS.items()):
        nq = a9.q_bufs(bm, bn, stages, d)
        assert 2 * nq * bm * d * 2 + 2 * stages * bn * d * 2 + 1024 <= a9.SMEM_PER_BLOCK, (d, nq)
    assert set(a9.CONFIGS) == {64, 80, 96, 128, 192, 256}
    assert a9.TILE_D == {80: 128, 96: 128, 192: 256}  # (D = 192 on the D = 256 kernel's tiles, 80 / 96 on D = 128's)
    assert all(a9.CONFIGS[d] == a9.CONFIGS[t] for d, t in a9.TILE_D.items())
    q = torch.zeros(1, 1, 64, 256, dtype=torch.bfloat16)
    assert a9.unsupported(q, q, q, None, dropout_p=0.0, scale=1.0, varlen=False) == "not an sm_90 GPU"


def test_d256_tables_pruned_by_shared_memory(monkeypatch):
    """At D = 256 (the tier of 128 < D <= 256) the pruner keeps the entries whose sm_90 shared memory
    (``_SMEM_256``: without mask and dropout, and the most with them) fits the device's opt-in limit, in table order
    (``PYKERNELS_AUTOTUNE=0`` takes the first); the smallest entry when none fits; the whole table when no CUDA
    tensor names a device; other tiers and fp32 untouched."""
    import types

    import triton

    from pykernels._kernels import attention as tri
    limit = {"value": None}
    monkeypatch.setattr(tri._tuning, "device_properties",
                        lambda dev: types.SimpleNamespace(shared_memory_per_block_optin=limit["value"]))
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))

    def kept(kind, d, **extra):
        kinds = (kind, "fp32_" + kind) + (("fwd_short",) if kind == "fwd" else ())
        configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                   for bm, bn, w, st in dict.fromkeys(e for k in kinds for t in tri._TABLE[k].values() for e in t)]
        args = {"BLOCK_D": d, "BLOCK_DV": d, "HAS_DROPOUT": False, "PTX_DROPOUT": False, "PRECISION": "tf32",
                "MASK_KIND": 0, **extra}
        got = tri._pruner(kind)(configs, {"seq_bucket": 2048, "Q": on_gpu}, **args)
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in got]

    for kind in ("fwd", "dkdv", "dq"):
        table = tri._TABLE[kind][256]
        assert set(table) <= set(tri._SMEM_256[kind]), kind  # every entry has its sizes
        plain = [tri._SMEM_256[kind][t][0] for t in table]
        assert plain[-1] == min(plain) and plain[-1] <= 101376, kind  # the last fits a 99 KiB card
        assert all(a <= b for a, b in tri._SMEM_256[kind].values()), kind
        for value in (232448, 166912, 101376):  # H100 / H200, A100, sm_86 / sm_89
            limit["value"] = value
            for extra, i in (({}, 0), ({"HAS_DROPOUT": True}, 1), ({"MASK_KIND": 2}, 1), ({"MASK_KIND": 3}, 1)):
                want = [t for t in table if tri._SMEM_256[kind][t][i] <= value] or table[-1:]
                assert kept(kind, 256, **extra) == want, (kind, value, extra)
        limit["value"] = 1024
        assert kept(kind, 256) == table[-1:], kind
        assert kept(kind, 128) == tri._TABLE[kind][128], kind  # (only D = 256's tier)
        assert kept(kind, 256, PRECISION="ieee") == tri._TABLE["fp32_" + kind][256], kind
        limit["value"] = None
        assert kept(kind, 256) == table, kind
    limit["value"] = 232448
    assert kept("fwd", 256)[0] == (128, 64, 8, 2) and kept("dkdv", 256)[0] == (64, 64, 8, 2)
    assert kept("dq", 256)[0] == (128, 32, 8, 3) and kept("dq", 256, HAS_DROPOUT=True)[0] == (128, 32, 8, 2)
    assert kept("dq", 256, MASK_KIND=2)[0] == (128, 32, 8, 2)
    limit["value"] = 166912
    assert kept("dkdv", 256)[0] == (32, 64, 8, 3) and kept("dq", 256)[0] == (64, 32, 8, 2)
    assert kept("dkdv", 256, MASK_KIND=4)[0] == (32, 64, 8, 2)


def test_keep_buffer_sizes_caps_and_env():
    """``keep_buffer``: heads padded to 128 queries x 128 keys (16 groups of 8), B H of them; None over
    ``KEEP_BUFFER_MB`` or where a head's bytes reach 2^31 (nothing allocated); ``PYKERNELS_TRITON_KEEP_BUFFER_MB``
    takes MiB >= 0 and names itself otherwise."""
    from pykernels._kernels import attention as tri
    buf, head, groups = tri.keep_buffer(2, 3, 200, 300, "cpu")
    assert (head, groups) == (256 * 48, 48) and buf.dtype == torch.uint8 and buf.numel() == 2 * 3 * head
    assert tri.keep_buffer(1, 1, 2**20, 2**17, "cpu") is None  # (a head of 2^34 bytes)
    old = tri.KEEP_BUFFER_MB
    try:
        tri.KEEP_BUFFER_MB = (2 * 3 * head - 1) / 2**20
        assert tri.keep_buffer(2, 3, 200, 300, "cpu") is None
        tri.KEEP_BUFFER_MB = 0
        assert tri.keep_buffer(1, 1, 16, 16, "cpu") is None
    finally:
        tri.KEEP_BUFFER_MB = old
    assert [tri._keep_buffer_mb(v) for v in ("1024", "", "0", "12.5")] == [1024.0, 0.0, 0.0, 12.5]
    for bad in ("abc", "-1", "nan"):
        with pytest.raises(ValueError, match="PYKERNELS_TRITON_KEEP_BUFFER_MB"):
            tri._keep_buffer_mb(bad)


@pytest.mark.parametrize("d,keep_mb,stored,want", [(64, 1024, False, (1, 2)), (32, 1024, False, (1, 2)),
                                                   (128, 1024, False, (0, 0)), (64, 0, False, (0, 0)),
                                                   (64, 1024, True, (2, 2)), (128, 0, True, (2, 2))])
def test_attention_bwd_takes_the_keep_buffer(monkeypatch, d, keep_mb, stored, want):
    """Which way ``attention_bwd``'s Triton kernels get their keep bits with the PTX draws (the launches captured on
    CPU tensors, the draws' rule forced on): (dQ KEEP_BUF, dK/dV KEEP_BUF) = (1 store, 2 load) at head dims up to
    ``KEEP_BUFFER_MAX_D`` under the cap, (0, 0) above it or with the cap 0, and (2, 2) with a forward's stored bits
    (``keep``), at any head dim; the dQ kernel launched first, both on the same buffer."""
    from pykernels._kernels import attention as tri
    b, h, s = 2, 2, 200
    q, k, v, o, do = (torch.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(b, h, s)
    got = []

    class Capture:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *a, **kw: got.append((self.fn, a, kw))
    monkeypatch.setattr(tri._launch, "fast", Capture)
    monkeypatch.setattr(tri, "_ptx_dropout", lambda *a, **kw: True)
    keep = tri.keep_buffer(b, h, s, s, "cpu") if stored else None  # (a forward's: the cap below is the backward's)
    monkeypatch.setattr(tri, "KEEP_BUFFER_MB", keep_mb)
    tri.attention_bwd(do, q, k, v, o, lse, None, causal=True, scale=d ** -0.5, dropout_p=0.1,
                      seed=torch.tensor([5]), keep=keep)
    names = [fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__ for fn, _, _ in got]
    assert names == ["_attention_bwd_dq_kernel", "_attention_bwd_dkdv_kernel"], names
    assert tuple(kw["KEEP_BUF"] for _, _, kw in got) == want
    if want != (0, 0):
        (_, a_dq, _), (_, a_dkdv, _) = got
        dq_buf = [t for t in a_dq if isinstance(t, torch.Tensor) and t.dtype == torch.uint8]
        dkdv_buf = [t for t in a_dkdv if isinstance(t, torch.Tensor) and t.dtype == torch.uint8]
        assert len(dq_buf) == len(dkdv_buf) == 1 and dq_buf[0] is dkdv_buf[0]
        if stored:
            assert dq_buf[0] is keep[0]
