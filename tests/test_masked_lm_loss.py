"""pykernels.masked_lm_loss: fused LM head + cross-entropy at the positions whose target is not
ignore_index. Every output and gradient is compared with the float64 reference by the three-way rule
(tests/utils.assert_close_to_ref). CPU: fp32/fp16 under the Triton interpreter, tiny shapes. GPU
(marked ``gpu``): bf16 at BERT-base / GPT-2 sizes, both backwards (sized: the valid count waited for
in the backward only; graph-safe: no wait), no sync in the forward, CUDA-graph capture, int64 offsets."""
from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
import torch.nn.functional as F

from pykernels import BackendUnavailableError, masked_lm_loss, shift_labels
from pykernels.masked_lm_loss import masked_lm_loss_reference
from pykernels._kernels import masked_lm_loss as kmod

from utils import assert_close_to_ref, cuda_built, max_err, needs_cuda_ext

IGN = -100


def _inputs(shape, h, v, dtype, device, *, frac=0.15, bias=False, ignore_index=IGN):
    """Fresh randn inputs; about ``frac`` of the positions keep a target, at least one."""
    hidden = torch.randn(*shape, h, device=device, dtype=dtype)
    weight = (torch.randn(v, h, device=device, dtype=dtype) * h**-0.5).to(dtype)
    b = torch.randn(v, device=device, dtype=dtype) if bias else None
    target = torch.randint(0, v, shape, device=device)
    keep = torch.rand(shape, device=device) < frac
    keep.view(-1)[0] = True
    target = torch.where(keep, target, torch.full_like(target, ignore_index))
    return hidden, weight, target, b


def _run(fn, hidden, weight, bias, grad_out, **kw):
    """Loss and gradients of fn(hidden, weight, bias=bias, **kw) with upstream grad ``grad_out``."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight)]
    b = bias.detach().clone().requires_grad_(True) if bias is not None else None
    loss = fn(leaves[0], leaves[1], bias=b, **kw)
    g = grad_out if grad_out is not None else torch.ones_like(loss)
    ins = leaves + ([b] if b is not None else [])
    grads = torch.autograd.grad(loss, ins, g.to(loss.dtype))
    return [loss.detach()] + [x.detach() for x in grads]


def _check(hidden, weight, target, bias=None, *, reduction="mean", label_smoothing=0.0, num_valid=None,
           grad_out=None, backend="triton", ignore_index=IGN, graph_safe=False, dense=False, max_valid=None,
           z_loss=0.0):
    """The kernel vs the float64 reference, bounded by twice the eager same-dtype reference's error."""
    kw = dict(reduction=reduction, label_smoothing=label_smoothing, num_valid=num_valid,
              ignore_index=ignore_index, z_loss=z_loss)
    if grad_out is None and reduction == "none":
        grad_out = torch.randn(target.shape, device=hidden.device)
    out = _run(lambda h, w, bias: masked_lm_loss(h, w, target, bias=bias, backend=backend,
                                                 graph_safe=graph_safe, dense=dense, max_valid=max_valid, **kw),
               hidden, weight, bias, grad_out)
    lo = _run(lambda h, w, bias: masked_lm_loss_reference(h, w, target, bias=bias, **kw),
              hidden, weight, bias, grad_out)
    b64 = bias.double() if bias is not None else None
    hi = _run(lambda h, w, bias: masked_lm_loss_reference(h, w, target, bias=bias, **kw),
              hidden.double(), weight.double(), b64, grad_out.double() if grad_out is not None else None)
    names = ["loss", "dhidden", "dweight", "dbias"]
    floors = _rounding_floors(hidden, weight, bias, target, reduction, num_valid, grad_out, ignore_index, z_loss)
    for name, o, h_, l_ in zip(names, out, hi, lo):
        assert o.dtype == (torch.float32 if name == "loss" else l_.dtype), name
        # atol scales with the reference: mean-reduced gradients are ~1/count small, and a fixed 1e-5
        # would swamp them (bf16 dhidden at BERT size is ~1e-5 itself).
        mag = h_.abs().max().item()
        # (gradients that are exactly 0 in the reference, e.g. V = 1, get the floor of the recomputed logits'
        # rounding)
        atol = 1e-5 * max(1.0, mag) if name == "loss" else max(1e-4 * mag, floors[name], 1e-7)
        assert_close_to_ref(name, o, h_, l_, atol=atol)
    return out


def _rounding_floors(hidden, weight, bias, target, reduction, num_valid, grad_out, ignore_index,
                     z_loss=0.0) -> dict:
    """Per gradient, the kernels' fp32 rounding of the logits carried into it. The backward recomputes each logit z
    (its product sums in another order than the forward's), so p = exp(z - lse) is off by about eps32 |z|. Where
    the references' gradient is exactly 0 (V = 1: p = 1 at every row, so (p - 1) h sums to 0) the kernels' is a sum
    of such terms: at most 4 eps32 max|z| times the sum over valid rows of |upstream| |operand| (the eager
    reference, which keeps its logits, has no such term, so the 2x rule alone would demand exact zeros; a fixed
    1e-7 floor failed on one CPU's BLAS, with 1.6e-7 at V = 1). With ``z_loss`` the softmax is scaled by
    1 + 2 z lse, and so is this floor."""
    h = hidden.detach().double().reshape(-1, hidden.shape[-1])
    w = weight.detach().double()
    valid = (target.reshape(-1) != ignore_index).double()
    z = h @ w.T + (bias.detach().double() if bias is not None else 0.0)
    zmax = (z.abs() * valid[:, None]).max().item()
    if reduction == "none":
        g = grad_out.detach().reshape(-1).double().abs()
    elif reduction == "sum":
        g = torch.ones_like(valid)
    else:
        g = torch.ones_like(valid) / max(float(num_valid if num_valid is not None else valid.sum()), 1.0)
    g = g * valid
    c = 4 * torch.finfo(torch.float32).eps * zmax
    if z_loss:
        lse = torch.logsumexp(z, dim=-1)
        c = c * (1 + 2 * z_loss * (lse * valid).abs().max().item())
    return {"dhidden": c * g.max().item() * w.abs().max().item(),
            "dweight": c * (g[:, None] * h.abs()).sum(0).max().item(), "dbias": c * g.sum().item()}


# ---- CPU (interpreter) correctness ------------------------------------------------------------------

CASES = [
    # dtype, V, bias, reduction, label_smoothing
    (torch.float32, 517, False, "mean", 0.0),
    (torch.float32, 517, True, "sum", 0.0),
    (torch.float32, 517, True, "none", 0.1),
    (torch.float32, 1, False, "mean", 0.0),
    (torch.float32, 1, True, "none", 0.0),
    (torch.float16, 517, False, "mean", 0.0),
    (torch.float16, 517, True, "none", 0.2),
    (torch.float16, 1, False, "sum", 0.0),
]


# The three backwards: sized (the valid count waited for in the backward), graph-safe (never waits,
# sized for all N), dense (every position a row, ignored ones masked: never waits, the sized kernels).
MODES = {"sized": dict(graph_safe=False, dense=False), "graph-safe": dict(graph_safe=True, dense=False),
         "dense": dict(graph_safe=False, dense=True)}
PATHS = {"sized": ["sized"], "graph-safe": ["graph-safe"], "dense": ["dense", "sized"]}


@pytest.fixture
def path_spy(monkeypatch):
    """Records which backward ran: "sized" (valid count known on the host), "graph-safe", "dense" (then "sized", the
    kernels it runs) or "bounded" (then "sized" and "graph-safe", its two passes)."""
    taken = []
    for name, label in (("masked_lm_loss_bwd_sized", "sized"), ("masked_lm_loss_bwd", "graph-safe"),
                        ("masked_lm_loss_bwd_dense", "dense"), ("masked_lm_loss_bwd_bounded", "bounded")):
        fn = getattr(kmod, name)
        monkeypatch.setattr(kmod, name, lambda *a, _fn=fn, _label=label, **k: (taken.append(_label), _fn(*a, **k))[1])
    return taken


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,v,bias,reduction,ls", CASES)
def test_matches_reference(device, dtype, v, bias, reduction, ls, mode, path_spy):
    hidden, weight, target, b = _inputs((37,), 32, v, dtype, device, frac=0.15, bias=bias)
    _check(hidden, weight, target, b, reduction=reduction, label_smoothing=ls, **MODES[mode])
    assert path_spy == PATHS[mode]


@pytest.mark.parametrize("warm_valid,graph_safe,expect", [(None, False, ["graph-safe"]),
                                                          (6, False, ["bounded", "sized", "graph-safe"]),
                                                          (40, False, ["dense", "sized"]),  # (dense: sized kernels)
                                                          (40, True, ["graph-safe"])])
def test_captured_backward_follows_the_eager_warm_up(device, monkeypatch, path_spy, warm_valid, graph_safe, expect):
    # A call captured in a CUDA graph cannot read its count on the host. Where an eager backward of as many positions
    # saw a valid count (the warm-up), the captured backward takes a capacity from it (the count plus eight binomial
    # standard deviations, here not rounded up: ALIGN 1): the bounded backward below it, the dense one from 90% of N
    # (a causal LM's warm-up); graph-safe without a warm-up or when the call names graph_safe=True. Capture is
    # simulated (the module's capturing() answers True): the captured call is exact whichever it takes, here against
    # the reference with a density unlike the warm-up's (the hint picks the faster path, never the result).
    mll = importlib.import_module("pykernels.masked_lm_loss")
    seen = mll._ValidSeen()
    seen.ALIGN = 1
    monkeypatch.setattr(mll, "_VALID_SEEN", seen)
    n = 41 if device.type == "cpu" else 4099  # (an N no other test's eager calls noted)
    if warm_valid is not None:
        warm = warm_valid if device.type == "cpu" else warm_valid * 100
        hidden, weight, target, _ = _inputs((n,), 32, 300, torch.float32, device, frac=1.0)
        target[warm:] = IGN
        _run(lambda h, w, bias: masked_lm_loss(h, w, target, backend="triton"), hidden, weight, None, None)
        assert path_spy == ["sized"]
        path_spy.clear()
    monkeypatch.setattr(mll, "capturing", lambda device=None: True)
    hidden, weight, target, b = _inputs((n,), 32, 300, torch.float32, device, frac=0.5, bias=True)
    _check(hidden, weight, target, b, reduction="sum", graph_safe=graph_safe)
    if expect[0] == "bounded":  # (one pass a block of overflow rows: several at the GPU's N)
        assert path_spy[:2] == expect[:2] and set(path_spy[2:]) == {"graph-safe"}
    else:
        assert path_spy == expect


def _simulate_bounded_capture(monkeypatch, bound: int) -> None:
    """Calls as if captured in a CUDA graph (the module's capturing() answers True) whose warm-up left the capacity
    ``bound``: their backward is the bounded one for it."""
    mll = importlib.import_module("pykernels.masked_lm_loss")
    seen = mll._ValidSeen()
    monkeypatch.setattr(seen, "bound", lambda dev, n: bound)
    monkeypatch.setattr(mll, "_VALID_SEEN", seen)
    monkeypatch.setattr(mll, "capturing", lambda device=None: True)


BOUNDED_CASES = [(torch.float32, True, "sum", 0.0), (torch.float16, True, "none", 0.1),
                 (torch.float32, False, "mean", 0.0)]


@pytest.mark.parametrize("dtype,bias,reduction,ls", BOUNDED_CASES)
@pytest.mark.parametrize("past", [-4, 0, 5, None], ids=["overflow", "at", "below", "zero"])
def test_captured_bounded_backward(device, monkeypatch, path_spy, dtype, bias, reduction, ls, past):
    # The bounded backward (a captured call whose warm-up left a capacity below 90% of N): the capacity pass for up
    # to `bound` rows and the graph-safe pass for the rows past it. Exact whether the count is below the bound, at it,
    # above it (the overflow rows through the graph-safe kernels, added into dweight / dbias, dhidden at their own
    # positions) or the bound 0 (every row overflows); with no overflow bit for bit the max_valid=bound call.
    hidden, weight, target, b = _inputs((41,), 32, 300, dtype, device, frac=0.5, bias=bias)
    m = int((target != IGN).sum())
    bound = 0 if past is None else max(m + past, 1)
    _simulate_bounded_capture(monkeypatch, bound)
    g = torch.randn(target.shape, device=device) if reduction == "none" else None
    out = _check(hidden, weight, target, b, reduction=reduction, label_smoothing=ls, grad_out=g)
    assert path_spy == ["bounded", "sized", "graph-safe"]
    if past is not None and past >= 0:
        path_spy.clear()
        want = _check(hidden, weight, target, b, reduction=reduction, label_smoothing=ls, grad_out=g, max_valid=bound)
        assert path_spy == ["sized"]
        for got, exp in zip(out, want):
            torch.testing.assert_close(got, exp, rtol=0, atol=0)


@pytest.mark.parametrize("dtype,bias,reduction,ls", BOUNDED_CASES)
def test_captured_bounded_backward_in_overflow_blocks(device, monkeypatch, path_spy, dtype, bias, reduction, ls):
    # The rows past the bound in blocks (a small first one, then at most OVERFLOW_BLOCKS - 1 even ones; here a first
    # block of 6 rows and an alignment of one row, so that 41 positions make four): two blocks with rows, the first
    # full, and two without. Exact against the reference, each block adding into dweight / dbias; and with the count
    # at the bound (no row past it) bit for bit the max_valid=bound call, every block's programs exiting at once.
    monkeypatch.setattr(kmod, "OVERFLOW_ALIGN", 1)
    monkeypatch.setattr(kmod, "OVERFLOW_FIRST_ROWS", 6)
    assert kmod.overflow_blocks(41, 4) == [(4, 6), (10, 11), (21, 11), (32, 9)]
    assert kmod.overflow_blocks(41, 0) == [(0, 6), (6, 12), (18, 12), (30, 11)]
    assert kmod.overflow_blocks(41, 38) == [(38, 3)] and kmod.overflow_blocks(41, 41) == []
    hidden, weight, target, b = _inputs((41,), 32, 300, dtype, device, frac=1.0, bias=bias)
    target[torch.randperm(41, device=device)[:23]] = IGN  # 18 valid: 6 past the bound in block 1, 8 in block 2
    _simulate_bounded_capture(monkeypatch, 4)
    g = torch.randn(target.shape, device=device) if reduction == "none" else None
    _check(hidden, weight, target, b, reduction=reduction, label_smoothing=ls, grad_out=g)
    assert path_spy == ["bounded", "sized"] + ["graph-safe"] * 4
    target[(target != IGN).nonzero()[4:, 0]] = IGN  # 4 valid: the count at the bound
    path_spy.clear()
    out = _check(hidden, weight, target, b, reduction=reduction, label_smoothing=ls, grad_out=g)
    assert path_spy == ["bounded", "sized"] + ["graph-safe"] * 4
    path_spy.clear()
    want = _check(hidden, weight, target, b, reduction=reduction, label_smoothing=ls, grad_out=g, max_valid=4)
    assert path_spy == ["sized"]
    for got, exp in zip(out, want):
        torch.testing.assert_close(got, exp, rtol=0, atol=0)


def test_captured_bounded_backward_says_once_without_graph_if(device, monkeypatch, path_spy):
    # Without the CUDA extension's IF nodes a captured call's overflow blocks run at every replay: exact (the tests
    # above), slower, and said once by a PerformanceWarning naming why; with the IF nodes nothing is said.
    import warnings

    import pykernels
    be = importlib.import_module("pykernels._backend")
    mll = importlib.import_module("pykernels.masked_lm_loss")
    monkeypatch.setattr(be, "_warned", set())
    hidden, weight, target, b = _inputs((41,), 32, 300, torch.float32, device, frac=0.5)
    _simulate_bounded_capture(monkeypatch, 4)
    monkeypatch.setattr(mll, "graph_if_support", lambda: (None, "no graph_if (test)"))
    said = r"^pykernels\.masked_lm_loss: .*overflow-row blocks at every replay.*\(no graph_if \(test\)\)"
    with pytest.warns(pykernels.PerformanceWarning, match=said):
        _check(hidden, weight, target, b)
    assert path_spy[:2] == ["bounded", "sized"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", pykernels.PerformanceWarning)
        _check(hidden, weight, target, b)  # (once a process)
        monkeypatch.setattr(be, "_warned", set())
        monkeypatch.setattr(mll, "graph_if_support", lambda: ((None, None), None))
        _check(hidden, weight, target, b)  # (the IF nodes there: silent)
    assert path_spy.count("bounded") == 3


@pytest.mark.parametrize("vc,splits,past", [(300, 8, 0), (40, 4, 0), (40, 3, 5), (100, 8, 2)],
                         ids=["one-chunk", "chunks-empty-split", "chunks-rows-past-count", "chunks-8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_overflow_block_dhidden_split(device, dtype, vc, splits, past):
    # An overflow block's dhidden with each chunk's columns split S ways (partial sums added by _dhidden_reduce_kernel)
    # gives the unsplit block's gradients (which the bounded tests above check against the reference): V in one chunk
    # or several (the fp32 accumulator across them), splits whose column range is empty (40 columns 4 ways at the
    # interpreter's BLOCK_K of 16: 16, 16, 8 and none), and buffer rows past the device count (never read or
    # written). dweight / dbias bit for bit (the same dW programs), dhidden to the fp32 sums' order; every split's
    # partial sums written.
    hidden, weight, target, b = _inputs((41,), 32, 300, dtype, device, frac=0.6, bias=True)
    rows, count, loss, lse = kmod.compact(target, IGN)
    kmod.masked_lm_loss_fwd(hidden, weight, target, b, rows, count, label_smoothing=0.1, loss=loss, lse=lse)
    m = int(count)
    r = m + past  # the block's buffer rows
    g = torch.randn(41, device=device)
    h = hidden.shape[1]
    out, parts = [], []
    for k in (1, splits):
        dl = torch.full((r, vc), float("nan"), dtype=dtype, device=device)
        acc = torch.full((r, h), float("nan"), device=device) if vc < 300 else None
        part = torch.full((k, r, h), float("nan"), device=device) if k > 1 else None
        grads = (torch.zeros_like(hidden), torch.zeros_like(weight), torch.zeros_like(b))
        out.append(kmod.masked_lm_loss_bwd(g, hidden, weight, target, b, lse, rows[:r], count, label_smoothing=0.1,
                                           n_rows=r, into=grads, row_programs=1, work=(dl, acc, part)))
        parts.append(part)
    (dh1, dw1, db1), (dhs, dws, dbs) = out
    assert torch.equal(dw1, dws) and torch.equal(db1, dbs)
    assert torch.isfinite(parts[1][:, :m]).all() and parts[1][:, m:].isnan().all()
    valid = target != IGN
    assert not dhs[~valid].any() and dhs[valid].abs().sum() > 0
    torch.testing.assert_close(dhs, dh1, rtol=2e-3 if dtype == torch.float16 else 1e-5, atol=1e-6)


# z_loss: PaLM's z lse**2 a valid row, through every backward (the kernels take lse - log1p(2 z lse)).
Z_CASES = [(torch.float32, True, "mean", 0.0), (torch.float32, False, "none", 0.1), (torch.float16, True, "sum", 0.0),
           (torch.float16, False, "mean", 0.2)]


@pytest.mark.parametrize("mode", [*MODES, "max_valid", "bounded-overflow", "reference"])
@pytest.mark.parametrize("dtype,bias,reduction,ls", Z_CASES)
def test_z_loss_matches_reference(device, monkeypatch, path_spy, mode, dtype, bias, reduction, ls):
    hidden, weight, target, b = _inputs((41,), 32, 517, dtype, device, frac=0.4, bias=bias)
    m = int((target != IGN).sum())
    kw, want = dict(MODES.get(mode, {})), PATHS.get(mode)
    if mode == "max_valid":
        kw, want = dict(max_valid=m + 3), ["sized"]
    elif mode == "bounded-overflow":
        _simulate_bounded_capture(monkeypatch, max(m - 5, 1))
        want = ["bounded", "sized", "graph-safe"]
    elif mode == "reference":
        kw, want = dict(backend="reference"), []
    g = torch.randn(target.shape, device=device) if reduction == "none" else None
    out = _check(hidden, weight, target, b, reduction=reduction, label_smoothing=ls, grad_out=g, z_loss=0.05, **kw)
    assert path_spy == want
    # the term is there: without it the loss and the gradients differ
    plain = _run(lambda h, w, bias: masked_lm_loss_reference(h, w, target, bias=bias, reduction=reduction,
                                                             label_smoothing=ls),
                 hidden.double(), weight.double(), b.double() if b is not None else None,
                 g.double() if g is not None else None)
    for got, p in zip(out, plain):
        assert max_err(got, p) > 1e-2 * max(p.abs().max().item(), 1e-3)


def test_z_loss_reference_is_palms_term():
    # The reference by hand in float64: cross-entropy plus z lse**2 at the valid positions (0 at ignored ones), and
    # its dlogits g ((1 + 2 z lse) softmax - onehot), which the kernels' shifted lse reproduces.
    hidden, weight, target, b = _inputs((23,), 16, 40, torch.float64, "cpu", frac=0.5, bias=True)
    z, valid = 0.3, target != IGN
    logits = (hidden @ weight.T + b).requires_grad_(True)
    lse = torch.logsumexp(logits, -1)
    t = target.clamp(min=0)
    want = torch.where(valid, lse - logits.gather(1, t[:, None])[:, 0] + z * lse * lse, 0.0)
    got = masked_lm_loss_reference(hidden, weight, target, bias=b, reduction="none", z_loss=z)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (dl,) = torch.autograd.grad(want.sum(), [logits])
    p = torch.softmax(logits.detach(), -1)
    by_hand = torch.where(valid[:, None], (1 + 2 * z * lse.detach())[:, None] * p - F.one_hot(t, 40), 0.0)
    torch.testing.assert_close(dl, by_hand, rtol=1e-12, atol=1e-12)
    shifted = lse.detach() - torch.log1p(2 * z * lse.detach())
    torch.testing.assert_close(torch.exp(logits.detach() - shifted[:, None]), (1 + 2 * z * lse.detach())[:, None] * p,
                               rtol=1e-12, atol=1e-12)


def test_z_loss_negative_factor_gives_nan_gradients_and_the_right_loss(device):
    # Rows whose lse is below -1 / (2 z) (here every logit near -20, z = 0.1: 1 + 2 z lse < 0) have a negative
    # softmax factor that a shifted lse cannot carry: NaN gradients there (documented), never a wrong finite one;
    # the loss is still right.
    hidden, weight, target, _ = _inputs((37,), 32, 517, torch.float32, device, frac=0.3)
    b = torch.full((517,), -20.0, device=device)
    out = _run(lambda h, w, bias: masked_lm_loss(h, w, target, bias=bias, z_loss=0.1, reduction="sum",
                                                 backend="triton"), hidden, weight, b, None)
    ref = masked_lm_loss_reference(hidden.double(), weight.double(), target, bias=b.double(), z_loss=0.1,
                                   reduction="sum")
    torch.testing.assert_close(out[0].double(), ref, rtol=1e-5, atol=1e-3)
    valid = target != IGN
    assert torch.isnan(out[1][valid]).all() and not torch.isnan(out[1][~valid]).any()
    assert torch.isnan(out[2]).any() and torch.isnan(out[3]).any()


def test_z_loss_bad_values_and_the_cuda_cover():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="z_loss"):
            masked_lm_loss(h, w, t, z_loss=bad)
    for bad in (True, "0.1", None):
        with pytest.raises(TypeError, match="z_loss"):
            masked_lm_loss(h, w, t, z_loss=bad)
    mll = importlib.import_module("pykernels.masked_lm_loss")
    assert mll._cuda_cover(h, w, t, None, False, False, 0, None) is None
    assert "z_loss" in mll._cuda_cover(h, w, t, None, False, False, 0, None, 1e-4)


def test_captured_bounded_backward_after_the_torch_compaction(device, monkeypatch, path_spy):
    # Past COMPACT_KERNEL_MAX_N positions the rows come from torch's compaction (``compact_rows``); the overflow
    # pass reads them from the bound on, as it does the kernel's.
    monkeypatch.setattr(kmod, "COMPACT_KERNEL_MAX_N", 16)
    hidden, weight, target, b = _inputs((37,), 32, 517, torch.float16, device, frac=0.5, bias=True)
    m = int((target != IGN).sum())
    _simulate_bounded_capture(monkeypatch, max(m - 6, 1))
    _check(hidden, weight, target, b, reduction="sum", label_smoothing=0.1)
    assert path_spy == ["bounded", "sized", "graph-safe"]


def test_valid_seen_bound():
    # the capacity from a warm-up's count: mean + 8 binomial standard deviations + 1, up to a multiple of ALIGN rows,
    # at most N; no hint, no bound
    mll = importlib.import_module("pykernels.masked_lm_loss")
    seen = mll._ValidSeen()
    dev = torch.device("cpu")
    assert seen.bound(dev, 16384) is None
    seen.note(dev, 16384, 2446)  # BERT-base's 15%
    assert seen.bound(dev, 16384) == 2816  # 2446 + 8 * 45.6 + 1 = 2812 -> 2816
    seen.note(dev, 8192, 8184)  # GPT-2 after shift_labels: every sequence's last position ignored
    assert seen.bound(dev, 8192) == 8192
    seen.note(dev, 1000, 0)
    assert seen.bound(dev, 1000) == 64
    assert seen.bound(dev, 16384) == 2816 and seen.bound(torch.device("meta"), 16384) is None


def test_sized_backward_with_chunks_and_every_row_valid(device, monkeypatch, path_spy):
    # every row valid (the causal-LM case: the gathered rows are hidden itself, strided here) and a budget
    # small enough for three vocabulary chunks: the fp32 dhidden accumulator is carried across them
    monkeypatch.setattr(kmod, "SIZED_DLOGITS_BUDGET_BYTES", 37 * 4 * 256)
    assert kmod._chunk_columns(37, 700, 4, kmod.SIZED_DLOGITS_BUDGET_BYTES) == 256
    base, _, target, b = _inputs((37,), 64, 700, torch.float32, device, frac=1.0, bias=True)
    hidden = base[:, ::2]  # (37, 32), row stride 64, column stride 2
    weight = torch.randn(700, 32, device=device) * 32**-0.5
    assert (target != IGN).all()
    _check(hidden, weight, target, b, reduction="none", label_smoothing=0.1)
    assert path_spy == ["sized"]


def test_sized_backward_fp16_chunks(device, monkeypatch, path_spy):
    monkeypatch.setattr(kmod, "SIZED_DLOGITS_BUDGET_BYTES", 1)  # 256-column chunks: 256, 256, 5
    hidden, weight, target, b = _inputs((37,), 32, 517, torch.float16, device, frac=0.5, bias=True)
    _check(hidden, weight, target, b, reduction="mean")
    assert path_spy == ["sized"]


def test_sized_backward_dlogits_in_dhidden_memory(device, monkeypatch, path_spy):
    # Few valid rows: the (M, VC) dlogits chunks fit in dhidden's N x H memory and use it (budget 1 byte:
    # dhidden's memory alone sets the chunk width, 2 chunks here); dhidden must still come out exactly
    # zero at the ignored rows, however the chunks filled that memory.
    monkeypatch.setattr(kmod, "SIZED_DLOGITS_BUDGET_BYTES", 1)
    taken = []
    real = kmod._chunk_columns
    monkeypatch.setattr(kmod, "_chunk_columns", lambda *a: (taken.append(a), real(*a))[1])
    hidden, weight, target, b = _inputs((64,), 64, 517, torch.float16, device, frac=0.1, bias=True)
    m = int((target != IGN).sum())
    out = _check(hidden, weight, target, b, reduction="sum", label_smoothing=0.1)
    assert path_spy == ["sized"]
    # both layouts are sized (dhidden's memory; a buffer of the budget plus dhidden's bytes): with a 1-byte
    # budget they give as many chunks, and the tie goes to dhidden's memory (no extra peak)
    # (the dz tiles' geometry rides along as a fifth argument: test_chunk_width_for_whole_rounds_of_tiles)
    assert [a[:4] for a in taken] == [(m, 517, 2, 64 * 64 * 2), (m, 517, 2, 1 + 64 * 64 * 2)]
    assert kmod._tuning.cdiv(517, real(*taken[0])) >= 2
    dh = out[1]
    assert (dh[target == IGN] == 0).all()


def test_sized_backward_chunk_buffer_takes_dhidden_bytes_when_chunks_do_not_fit_there(device, monkeypatch,
                                                                                     path_spy):
    # Every row valid: a chunk of the budget does not fit in dhidden's memory, so dhidden is allocated only
    # after the chunks and the chunk buffer gets the budget plus dhidden's bytes (here 512 columns of
    # budget + 256 of dhidden: 2 chunks of 768 instead of 3 of 512); dhidden still comes out right.
    m, h, v = 37, 256, 1500
    monkeypatch.setattr(kmod, "SIZED_DLOGITS_BUDGET_BYTES", m * 4 * 512)
    taken = []
    real = kmod._chunk_columns
    monkeypatch.setattr(kmod, "_chunk_columns", lambda *a: (taken.append((a, real(*a))), real(*a))[1])
    hidden, weight, target, b = _inputs((m,), h, v, torch.float32, device, frac=1.0, bias=False)
    assert (target != IGN).all()
    _check(hidden, weight, target, b, reduction="mean")
    assert path_spy == ["sized"]
    assert taken[-1] == ((m, v, 4, m * 4 * 512 + m * h * 4, None), 768)  # (fp32: no TMA tiles, no waves)


def test_sized_backward_dlogits_in_dweight_rows_not_yet_written(device, monkeypatch, path_spy):
    # Every row valid and a 1-byte budget: 256-column chunks, except that the first chunks are wider and
    # keep their dlogits in the rows of dweight that later chunks write (fp16: the TMA path, which pads
    # dweight to 8 rows). dweight must come out right in every row, the scratch rows included.
    monkeypatch.setattr(kmod, "SIZED_DLOGITS_BUDGET_BYTES", 1)
    plan = kmod._chunk_plan(2000, 256, 37, 64, 8, 2000)
    assert [s for *_, s in plan] == [True, True, False, False] and sum(w for _, w, _ in plan) == 2000
    hidden, weight, target, b = _inputs((37,), 64, 2000, torch.float16, device, frac=1.0, bias=True)
    assert (target != IGN).all()
    _check(hidden, weight, target, b, reduction="mean", label_smoothing=0.1)
    assert path_spy == ["sized"]


def test_chunk_plan_covers_the_vocabulary_once():
    for v, vc, m, h in [(50257, 1024, 8192, 768), (30522, 5120, 2446, 768), (517, 256, 5, 32), (7, 7, 3, 8)]:
        for dw_rows in (0, -(-v // 8) * 8):
            plan = kmod._chunk_plan(v, vc, m, h, 8, dw_rows)
            assert [o for o, _, _ in plan] == [sum(w for _, w, _ in plan[:i]) for i in range(len(plan))]
            assert sum(w for _, w, _ in plan) == v
            for v_off, w, scratch in plan:
                w_pad = -(-w // 8) * 8
                assert (not scratch) or (dw_rows and (v_off + w_pad) * h + m * w_pad <= dw_rows * h)
                assert scratch or w <= vc
    assert len(kmod._chunk_plan(50257, 1024, 8192, 768, 8, 50264)) == 29  # 50 without the scratch


def test_chunk_layout_takes_the_one_with_fewer_chunks():
    # (VC, shared) for BERT-base MLM, BERT-large and GPT-2 (bf16, TMA padding, dW scratch rows): the own
    # buffer (budget + dhidden's bytes) where it needs fewer chunks than dhidden's memory, dhidden's memory
    # on a tie (no extra peak), the own buffer where the chunks do not fit in dhidden (every row valid).
    budget = kmod.SIZED_DLOGITS_BUDGET_BYTES
    for (n, m, h, v), want_shared, want_chunks in [((16384, 2446, 768, 30522), False, 4),
                                                   ((16384, 2377, 1024, 30522), False, 3),
                                                   ((8192, 8192, 768, 50257), False, 22),
                                                   ((16384, 2446, 768, 4096), True, 1)]:
        rows = -(-v // 8) * 8
        vc, shared, plan = kmod._chunk_layout(m, v, h, 2, budget, n * h, 2, 8, rows)
        assert shared == want_shared
        assert plan == kmod._chunk_plan(v, vc, m, h, 8, rows)
        assert len(plan) == want_chunks
        held = m * -(-vc // 8) * 8 * 2  # the chunk buffer's bytes
        assert held <= (n * h * 2 if shared else budget + n * h * 2)


@pytest.mark.parametrize("value,want", [(None, (True, True, True)), ("0", (False, False, True)),
                                        ("dz", (False, True, True)), ("fwd", (True, False, True))])
def test_sm90_and_wave_switches_read_at_import(value, want):
    # PYKERNELS_MLM_SM90 picks the logits kernels that take the Gluon kernel on sm_90 (1: both, the forward only
    # with a bias; 0: neither; dz / fwd: that one); PYKERNELS_MLM_WAVE_CHUNKS=0 turns the wave-sized chunks off
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("PYKERNELS_MLM_SM90", "PYKERNELS_MLM_WAVE_CHUNKS")}
    if value is not None:
        env["PYKERNELS_MLM_SM90"] = value
    code = ("from pykernels._kernels import masked_lm_loss as k; print(k.SM90_FWD, k.SM90_DZ, k.WAVE_CHUNKS)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(x) for x in want]
    env["PYKERNELS_MLM_WAVE_CHUNKS"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[2] == "False", out.stderr[-2000:]


def test_chunk_width_for_whole_rounds_of_tiles():
    # With the dz kernel's geometry (row tiles, tile columns, programs) the width is the one whose chunks take
    # the fewest rounds of tiles, within the same budget and the same number of chunks
    budget = kmod.SIZED_DLOGITS_BUDGET_BYTES

    def rounds(plan, m, bn=128, programs=132):
        return sum(-(-(-(-m // 128) * -(-w // bn)) // programs) for _, w, _ in plan)
    for (n, m, h, v), want_vc, want_rounds in [((16384, 2446, 768, 30522), 8320, (39, 37)),
                                                ((16384, 2377, 1024, 30522), 10496, (36, 35)),
                                                ((16384, 2446, 768, 4096), 4096, (5, 5))]:
        rows = -(-v // 8) * 8
        waves = (-(-m // 128), 128, 132)
        vc0, shared0, plan0 = kmod._chunk_layout(m, v, h, 2, budget, n * h, 2, 8, rows)
        vc, shared, plan = kmod._chunk_layout(m, v, h, 2, budget, n * h, 2, 8, rows, waves)
        assert vc == want_vc and shared == shared0 and len(plan) == len(plan0)
        assert (rounds(plan0, m), rounds(plan, m)) == want_rounds
        assert sum(w for _, w, _ in plan) == v
        assert m * -(-vc // 8) * 8 * 2 <= (n * h * 2 if shared else budget + n * h * 2)
    # no better width: the even one
    assert kmod._chunk_columns(2446, 30522, 2, 40 * 2**20, (20, 256, 132)) in (7680, 7936, 8192)


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointer"])
def test_fp16_logit_tiles_through_tma_and_pointers(device, monkeypatch, use_tma):
    # fp16 takes the tensor-descriptor kernel on Hopper and under the interpreter; both paths must hold.
    monkeypatch.setattr(kmod, "USE_TMA", use_tma)
    calls = []
    real = kmod._logits_tma
    monkeypatch.setattr(kmod, "_logits_tma", lambda *a, **k: (calls.append(k["dz"]), real(*a, **k))[1])
    hidden, weight, target, b = _inputs((37,), 32, 517, torch.float16, device, frac=0.3, bias=True)
    _check(hidden, weight, target, b, reduction="none", label_smoothing=0.1)
    applies = torch.device(device).type == "cpu" or torch.cuda.get_device_capability()[0] >= 9
    assert calls == ([False, True] if use_tma and applies else [])


@pytest.mark.parametrize("target_dot", [True, False], ids=["dot-in-combine", "in-tiles"])
@pytest.mark.parametrize("smoothing,bias", [(0.0, True), (0.1, False)])
def test_target_logit_from_the_combine_kernel_or_the_tiles(device, monkeypatch, target_dot, smoothing, bias):
    # The TMA forward's tiles leave the target logit to the combine kernel (a dot product with the target's
    # weight row, plus its bias); PYKERNELS_MLM_TARGET_DOT=0 picks it out of the tiles. Both against the
    # reference, with an out-of-range target (NaN loss at its row, never a read out of bounds).
    monkeypatch.setattr(kmod, "FWD_TARGET_DOT", target_dot)
    hidden, weight, target, b = _inputs((37,), 32, 517, torch.float16, device, frac=0.4, bias=bias)
    _check(hidden, weight, target, b, reduction="none", label_smoothing=smoothing)
    bad = target.clone()
    row = int((bad != IGN).nonzero()[0])
    bad[row] = 517
    loss = masked_lm_loss(hidden, weight, bad, bias=b, reduction="none", backend="triton")
    assert torch.isnan(loss[row]) and torch.isfinite(loss[torch.arange(37, device=device) != row]).all()


@pytest.mark.parametrize("ignore_index", [None, IGN], ids=["zero-fill", "one-launch"])
def test_sized_backward_poisons_a_wrong_host_count(device, ignore_index):
    # The grid of the sized backward is sized by the host count; a count that is not the device's must
    # never give a silently partial gradient. With ignore_index the last step writes every position of
    # dhidden in one launch (rows scattered, 0 at ignored positions): NaN at every valid position then.
    hidden, weight, target, _ = _inputs((37,), 32, 517, torch.float32, device, frac=0.5)
    from pykernels.masked_lm_loss import compact_rows
    rows, count = compact_rows(target, IGN)
    lse = torch.logsumexp(hidden @ weight.t(), -1)
    g = torch.ones(37, device=device)
    m = int(count)
    kw = dict(label_smoothing=0.0, ignore_index=ignore_index)
    good = kmod.masked_lm_loss_bwd_sized(g, hidden, weight, target, None, lse, rows, count, m, **kw)
    assert all(torch.isfinite(t).all() for t in good[:2])
    assert (good[0][target == IGN] == 0).all() and (good[0][target != IGN].abs().sum(-1) > 0).all()
    for wrong in (m - 1, m + 1):
        dh, dw, _ = kmod.masked_lm_loss_bwd_sized(g, hidden, weight, target, None, lse, rows, count, wrong, **kw)
        assert torch.isnan(dw).all()
        assert torch.isnan(dh[target != IGN]).any()
        if ignore_index is not None:
            assert torch.isnan(dh[target != IGN]).all() and (dh[target == IGN] == 0).all()
    with pytest.raises(ValueError, match="num_rows"):
        kmod.masked_lm_loss_bwd_sized(g, hidden, weight, target, None, lse, rows, count, 38, label_smoothing=0.0)


def test_dhidden_is_zero_at_ignored_rows(device):
    hidden, weight, target, _ = _inputs((37,), 32, 517, torch.float32, device, frac=0.3)
    _, dh, _ = _run(lambda h, w, bias: masked_lm_loss(h, w, target, backend="triton"), hidden, weight, None, None)
    ignored = target == IGN
    assert ignored.any() and (~ignored).any()
    assert torch.equal(dh[ignored], torch.zeros_like(dh[ignored]))
    assert (dh[~ignored].abs().sum(-1) > 0).all()


def test_several_vocab_slices_and_backward_chunks(device, monkeypatch):
    # V = 2100 gives the forward three vocabulary slices (1024, 1024, 52 columns); a tiny dlogits budget
    # gives the backward three chunks, exercising the fp32 dhidden accumulator across chunks.
    monkeypatch.setattr(kmod, "DLOGITS_BUDGET_BYTES", 37 * 4 * 1024)
    assert kmod._chunk_columns(37, 2100, 4, kmod.DLOGITS_BUDGET_BYTES) == 768
    hidden, weight, target, b = _inputs((37,), 32, 2100, torch.float32, device, frac=0.4, bias=True)
    _check(hidden, weight, target, b, reduction="none", label_smoothing=0.1, graph_safe=True)


def test_backward_chunks_with_narrow_last_chunk(device, monkeypatch):
    monkeypatch.setattr(kmod, "DLOGITS_BUDGET_BYTES", 37 * 4 * 256)
    assert kmod._chunk_columns(37, 517, 4, kmod.DLOGITS_BUDGET_BYTES) == 256  # chunks 256, 256, 5
    hidden, weight, target, b = _inputs((37,), 32, 517, torch.float16, device, frac=0.5, bias=True)
    _check(hidden, weight, target, b, reduction="mean", graph_safe=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_zero_grads(device, reduction, mode):
    hidden, weight, _, b = _inputs((37,), 32, 517, torch.float32, device, bias=True)
    target = torch.full((37,), IGN, device=device)
    out = _run(lambda h, w, bias: masked_lm_loss(h, w, target, bias=bias, reduction=reduction, backend="triton",
                                                 **MODES[mode]),
               hidden, weight, b, None)
    for name, t in zip(["loss", "dhidden", "dweight", "dbias"], out):
        assert torch.isfinite(t).all(), name
        assert torch.equal(t, torch.zeros_like(t)), name


def test_dense_backward_ignored_rows_with_huge_logits(device, path_spy):
    # dense: ignored rows go through the kernels too; their logits here overflow exp(z - 0), so only the
    # masked lse (+inf) keeps their gradient an exact 0 instead of 0 * inf = NaN.
    hidden, weight, target, b = _inputs((37,), 32, 517, torch.float16, device, frac=0.5, bias=True)
    hidden = hidden.clone()
    hidden[target == IGN] *= 400  # logits ~ +-1e3 at the ignored rows
    out = _check(hidden, weight, target, b, reduction="none", label_smoothing=0.1, dense=True)
    assert path_spy == PATHS["dense"]
    assert all(torch.isfinite(t).all() for t in out)
    assert (out[1][target == IGN] == 0).all()


def test_no_ignored_is_the_causal_lm_loss(device):
    # GPT: position i predicts token i + 1; shift_labels makes every position but the last valid.
    hidden, weight, _, _ = _inputs((2, 19), 32, 517, torch.float32, device)
    input_ids = torch.randint(0, 517, (2, 19), device=device)
    labels = shift_labels(input_ids)
    assert torch.equal(labels[:, :-1], input_ids[:, 1:]) and (labels[:, -1] == IGN).all()
    loss = masked_lm_loss(hidden, weight, labels, backend="triton")
    logits = (hidden.double() @ weight.double().t())[:, :-1].reshape(-1, 517)
    expected = F.cross_entropy(logits, input_ids[:, 1:].reshape(-1))
    assert abs(loss.item() - expected.item()) < 1e-5
    # every target valid (no ignore_index anywhere) through the kernel, all gradients
    full = torch.randint(0, 517, (2, 19), device=device)
    _check(hidden, weight, full, reduction="mean")


def test_shift_labels_keeps_dtype_and_custom_ignore_index():
    labels = torch.tensor([[5, 6, 7], [1, 2, 3]], dtype=torch.int32)
    out = shift_labels(labels, ignore_index=-1)
    assert out.dtype == torch.int32
    assert out.tolist() == [[6, 7, -1], [2, 3, -1]]
    with pytest.raises(TypeError, match="labels"):
        shift_labels(torch.randn(3))


def test_custom_ignore_index(device):
    hidden, weight, target, _ = _inputs((37,), 32, 517, torch.float32, device, frac=0.3, ignore_index=7)
    _check(hidden, weight, target, reduction="mean", ignore_index=7)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_num_valid_divides_by_the_global_count(device, as_tensor):
    hidden, weight, target, b = _inputs((37,), 32, 517, torch.float32, device, frac=0.3, bias=True)
    nv = torch.tensor(23, device=device) if as_tensor else 23
    out = _check(hidden, weight, target, b, reduction="mean", num_valid=nv)
    s = masked_lm_loss(hidden, weight, target, bias=b, reduction="sum", backend="triton")
    assert abs(out[0].item() - s.item() / 23) < 1e-5


def test_leading_dims_and_strided_hidden(device):
    # hidden (S, B, H) transposed to (B, S, H): non-contiguous, cannot be flattened without a copy;
    # a column slice of a wider tensor: strided rows, a view.
    base = torch.randn(5, 3, 32, device=device)
    hidden = base.transpose(0, 1)
    assert not hidden.is_contiguous()
    _, weight, target, b = _inputs((3, 5), 32, 517, torch.float32, device, frac=0.4, bias=True)
    _check(hidden, weight, target, b, reduction="none")
    wide = torch.randn(37, 48, device=device)[:, 8:40]
    wt = torch.randn(32, 517, device=device).t()  # weight (V, H) with strides (1, V)
    target1 = _inputs((37,), 32, 517, torch.float32, device, frac=0.3)[2]
    _check(wide, wt, target1, reduction="sum")
    column_major = torch.randn(32, 37, device=device).t()  # (N, H) with strides (1, N)
    _check(column_major, wt, target1, reduction="mean", label_smoothing=0.1)


@pytest.mark.parametrize("mode", MODES)
def test_upstream_gradient_read_through_its_stride(device, mode):
    # reduction="none" with a strided upstream gradient (stride 2), and "mean" / "sum" whose gradient arrives
    # expanded from one value (stride 0): the kernels read it in place, whatever the stride
    hidden, weight, target, b = _inputs((37,), 32, 517, torch.float16, device, frac=0.4, bias=True)
    g = torch.randn(74, device=device)[::2]
    assert g.stride(0) == 2
    _check(hidden, weight, target, b, reduction="none", grad_out=g, **MODES[mode])
    for reduction in ("mean", "sum"):
        _check(hidden, weight, target, b, reduction=reduction, grad_out=torch.tensor(0.7, device=device),
               **MODES[mode])


def test_out_of_range_target(device):
    hidden, weight, target, _ = _inputs((37,), 32, 517, torch.float32, device, frac=0.5)
    target[0] = 517
    target[1] = -3
    loss = masked_lm_loss(hidden, weight, target, reduction="none", backend="triton")
    assert torch.isnan(loss[0]) and torch.isnan(loss[1])
    ok = (target != IGN) & (torch.arange(37, device=device) > 1)
    ref = masked_lm_loss_reference(hidden.double(), weight.double(), torch.where(ok, target, IGN),
                                   reduction="none")
    assert max_err(loss[ok], ref[ok]) < 1e-4
    with pytest.raises(ValueError, match="target"):
        masked_lm_loss_reference(hidden, weight, target)
    with pytest.raises(ValueError, match="target"):
        masked_lm_loss(hidden, weight, target, backend="reference")


@pytest.mark.parametrize("max_valid,z_loss,backend", [(None, 0.0, "triton"), (16, 0.0, "triton"),
                                                     (None, 0.01, "triton"), (None, 0.01, "reference")],
                         ids=["sized", "max_valid", "z_loss", "reference"])
def test_torch_compile_fullgraph_matches_eager(device, max_valid, z_loss, backend):
    # (the reference backend's backward is written out: an autograd.grad inside the backward op found no graph in
    # torch.compile's backward)
    hidden, weight, target, b = _inputs((2, 11), 32, 517, torch.float32, device, frac=0.4, bias=True)
    assert int((target != IGN).sum()) <= 16

    def f(h, w, bias):
        return masked_lm_loss(h, w, target, bias=bias, label_smoothing=0.1, backend=backend, max_valid=max_valid,
                              z_loss=z_loss)

    eager = _run(f, hidden, weight, b, None)
    compiled = _run(torch.compile(f, fullgraph=True, backend="aot_eager"), hidden, weight, b, None)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=0, atol=0)


def test_auto_on_cpu_uses_reference_and_explicit_cuda_is_unavailable():
    hidden, weight, target, _ = _inputs((37,), 32, 517, torch.float32, "cpu")
    auto = masked_lm_loss(hidden, weight, target, backend="auto")
    ref = masked_lm_loss(hidden, weight, target, backend="reference")
    assert torch.equal(auto, ref)
    with pytest.raises(BackendUnavailableError, match="cuda"):
        masked_lm_loss(hidden, weight, target, backend="cuda")


def test_bad_inputs():
    h = torch.randn(4, 8)
    w = torch.randn(10, 8)
    t = torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="width"):
        masked_lm_loss(h, torch.randn(10, 9), t)
    with pytest.raises(ValueError, match="weight"):
        masked_lm_loss(h, torch.randn(10, 8, 1), t)
    with pytest.raises(ValueError, match="bias"):
        masked_lm_loss(h, w, t, bias=torch.randn(9))
    with pytest.raises(TypeError, match="bias"):
        masked_lm_loss(h, w, t, bias=torch.randn(10, dtype=torch.float64))
    with pytest.raises(TypeError, match="target"):
        masked_lm_loss(h, w, t.float())
    with pytest.raises(ValueError, match="target shape"):
        masked_lm_loss(h, w, t[:3])
    with pytest.raises(TypeError, match="weight"):
        masked_lm_loss(h, w.half(), t)
    with pytest.raises(TypeError, match="hidden"):
        masked_lm_loss(h.double(), w.double(), t)
    with pytest.raises(TypeError, match="hidden"):
        masked_lm_loss([1.0], w, t)
    with pytest.raises(ValueError, match="reduction"):
        masked_lm_loss(h, w, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        masked_lm_loss(h, w, t, label_smoothing=1.0)
    with pytest.raises(ValueError, match="num_valid"):
        masked_lm_loss(h, w, t, reduction="sum", num_valid=3)
    with pytest.raises(ValueError, match="num_valid"):
        masked_lm_loss(h, w, t, num_valid=0)
    with pytest.raises(TypeError, match="ignore_index"):
        masked_lm_loss(h, w, t, ignore_index=1.5)
    with pytest.raises(ValueError, match="backend"):
        masked_lm_loss(h, w, t, backend="cudnn")


# ---- GPU ------------------------------------------------------------------------------------------------

def _gpu_case(n, h, v, n_valid, *, bias=False):
    hidden, weight, target, b = _inputs((n,), h, v, torch.bfloat16, "cuda", frac=n_valid / n, bias=bias)
    return hidden, weight, target, b


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,h,v,frac,bias", [
    ("bert-base-mlm", 16384, 768, 30522, 0.15, True),
    ("bert-large-mlm", 16384, 1024, 30522, 0.15, False),
    ("gpt2-lm", 8192, 768, 50257, 1.0, False),
])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_bf16_realistic(name, n, h, v, frac, bias, mode, path_spy):
    hidden, weight, target, b = _inputs((n,), h, v, torch.bfloat16, "cuda", frac=frac, bias=bias)
    _check(hidden, weight, target, b, reduction="mean", **MODES[mode])
    assert path_spy == PATHS[mode]


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,h,v,frac,bias,mode", [
    ("bert-base-mlm", 16384, 768, 30522, 0.15, True, "sized"),
    ("bert-base-mlm", 16384, 768, 30522, 0.15, True, "graph-safe"),
    ("gpt2-lm", 8192, 768, 50257, 1.0, False, "dense"),
])
def test_gpu_z_loss_bf16(name, n, h, v, frac, bias, mode, path_spy):
    # PaLM's z-loss coefficient (1e-4) at realistic sizes, through the Hopper kernels where they apply
    hidden, weight, target, b = _inputs((n,), h, v, torch.bfloat16, "cuda", frac=frac, bias=bias)
    _check(hidden, weight, target, b, reduction="mean", z_loss=1e-4, **MODES[mode])
    assert path_spy == PATHS[mode]


@pytest.mark.gpu
def test_gpu_fp32_ieee_dot_none_reduction():
    # fp32 inputs take IEEE tl.dot (no TF32) so the kernel matches eager fp32; fp16 shares the bf16 code
    # path on the GPU and is covered on CPU.
    hidden, weight, target, b = _inputs((4, 300), 256, 5003, torch.float32, "cuda", frac=0.3, bias=True)
    _check(hidden, weight, target, b, reduction="none", label_smoothing=0.1)


@pytest.mark.gpu
def test_gpu_torch_compile_inductor_matches_eager():
    hidden, weight, target, b = _inputs((4, 256), 256, 5003, torch.bfloat16, "cuda", frac=0.15, bias=True)

    def f(h, w, bias):
        return masked_lm_loss(h, w, target, bias=bias, label_smoothing=0.1, backend="triton")

    eager = _run(f, hidden, weight, b, None)
    compiled = _run(torch.compile(f, fullgraph=True), hidden, weight, b, None)
    for e, c in zip(eager, compiled):
        # inductor may reorder the (N,)-vector sum of the mean or compute 1/count as a reciprocal: equal
        # up to one rounding in each dtype (assert_close's dtype-based defaults)
        torch.testing.assert_close(c, e)


@pytest.mark.gpu
@pytest.mark.parametrize("graph_safe", [False, True], ids=["sized", "graph-safe"])
def test_gpu_deterministic(graph_safe):
    # No atomics: two runs give bitwise-equal loss and gradients (several backward chunks).
    hidden, weight, target, b = _inputs((4096,), 256, 30522, torch.bfloat16, "cuda", frac=0.15, bias=True)

    def f(h, w, bias):
        return masked_lm_loss(h, w, target, bias=bias, backend="triton", graph_safe=graph_safe)

    first = _run(f, hidden, weight, b, None)
    second = _run(f, hidden, weight, b, None)
    for x, y in zip(first, second):
        assert torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_no_host_sync(mode):
    # The forward never synchronises; graph-safe or dense, the backward neither. (The sized backward
    # waits for the forward's count copy by design: test_gpu_sized_backward_waits_only_for_the_count.)
    hidden, weight, target, b = _inputs((2048,), 256, 8192, torch.bfloat16, "cuda", frac=0.15, bias=True)
    h = hidden.requires_grad_(True)
    w = weight.requires_grad_(True)
    bb = b.requires_grad_(True)
    kw = MODES[mode]
    for _ in range(2):  # compile and autotune (which synchronises) before watching
        masked_lm_loss(h, w, target, bias=bb, backend="triton", **kw).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = masked_lm_loss(h, w, target, bias=bb, backend="triton", **kw)
        if mode != "sized":
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if mode == "sized":
        loss.backward()
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_sized_backward_waits_only_for_the_count():
    # The sized backward must not wait for the forward's kernels: with a long kernel queued behind the
    # forward's count copy, the backward's host work finishes while the GPU is still busy.
    hidden, weight, target, b = _inputs((4096,), 256, 30522, torch.bfloat16, "cuda", frac=0.15, bias=True)
    h = hidden.requires_grad_(True)
    for _ in range(2):
        masked_lm_loss(h, weight, target, backend="triton").backward()
    torch.cuda.synchronize()
    loss = masked_lm_loss(h, weight, target, backend="triton")
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued after the forward
    done = torch.cuda.Event()
    loss.backward()
    done.record()
    assert not done.query(), "the backward waited for the whole queue"
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_count_copies_ring(path_spy):
    # The forwards' count copies share a ring of pinned slots: a forward whose backward runs more than a
    # ring's length of forwards later has lost its slot and takes the graph-safe backward (no wait); the
    # recent ones keep theirs. Every gradient is right either way.
    limit = _P._COUNTS._LIMIT
    hidden, weight, target, _ = _inputs((256,), 64, 512, torch.bfloat16, "cuda", frac=0.3)
    h = hidden.requires_grad_(True)
    losses = [masked_lm_loss(h * 1.0, weight, target, backend="triton") for _ in range(limit + 3)]
    ref = masked_lm_loss_reference(hidden.double(), weight.double(), target)
    (d_ref,) = torch.autograd.grad(masked_lm_loss(h, weight, target, backend="triton"), [h])
    path_spy.clear()
    for loss, exact in ((losses[-1], True), (losses[0], False)):
        assert abs(loss.item() - ref.item()) < 1e-2
        (dh,) = torch.autograd.grad(loss, [h])
        if exact:  # the same sized backward
            torch.testing.assert_close(dh, d_ref, rtol=0, atol=0)
        else:  # the graph-safe kernels: bf16 within a rounding
            torch.testing.assert_close(dh, d_ref)
    assert path_spy == ["sized", "graph-safe"]


@pytest.mark.gpu
def test_gpu_max_valid_captured_without_a_wait(path_spy):
    # max_valid: nothing synchronises in forward or backward; captured in a CUDA graph (the sized
    # backward for the bound) and replayed with other counts up to it, the graph equals the same call run
    # eagerly, bit for bit, and the reference within the bf16 rule's reach; above the bound, NaN gradients.
    hidden, weight, target, b = _inputs((4096,), 256, 8192, torch.bfloat16, "cuda", frac=0.15, bias=True)
    h = hidden.clone().requires_grad_(True)
    static_t = target.clone()
    cap = 1000

    def step():
        loss = masked_lm_loss(h, weight, static_t, bias=b, backend="triton", reduction="sum", max_valid=cap)
        (dh,) = torch.autograd.grad(loss, [h])
        return loss, dh

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _capture_replay_compare(step, step, static_t, (0.05, 0.2, 0.0))
    assert set(path_spy) == {"sized"}
    loss, dh = step()
    ref = masked_lm_loss_reference(hidden.float(), weight.float(), static_t, bias=b.float(), reduction="sum")
    assert abs(loss.item() - ref.item()) <= 1e-2 * abs(ref.item()) + 1e-3
    static_t.copy_(_inputs((4096,), 8, 8192, torch.bfloat16, "cuda", frac=0.5)[2])  # ~2048 > cap
    loss, dh = step()
    assert torch.isfinite(loss) and torch.isnan(dh[static_t != IGN]).all()


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_follows_the_data():
    # Captured once, replayed with a different number of valid targets: the valid count is data.
    hidden, weight, target, b = _inputs((4096,), 256, 8192, torch.bfloat16, "cuda", frac=0.15, bias=True)
    h = hidden.clone().requires_grad_(True)
    static_t = target.clone()

    def step():  # graph_safe=True: captured, the graph-safe backward whatever the warm-up saw
        loss = masked_lm_loss(h, weight, static_t, bias=b, backend="triton", reduction="sum", graph_safe=True)
        (dh,) = torch.autograd.grad(loss, [h])
        return loss, dh

    # the eager warm-up takes the graph-safe backward too (graph_safe=True never waits)
    _capture_replay_compare(step, step, static_t, (0.05, 0.5, 0.0))


@pytest.mark.gpu
def test_gpu_captured_mlm_takes_the_bounded_backward(monkeypatch, path_spy):
    # The default call captured after an eager warm-up at 15%: the bounded backward (capacity 15% + 8 standard
    # deviations), replayed below its bound, above it (50%, every target valid: the overflow rows through the
    # graph-safe kernels, in blocks each captured in an IF node, two and four of them taken) and with every target
    # ignored; bit for bit the same call run eagerly on the same path (capture simulated there: every block
    # launched), and within the bf16 rule of the reference above the bound.
    mll = importlib.import_module("pykernels.masked_lm_loss")
    monkeypatch.setattr(mll, "_VALID_SEEN", mll._ValidSeen())
    from pykernels._kernels import _tuning
    real_if, took_if = _tuning.graph_if, []

    @contextlib.contextmanager
    def graph_if(*args):
        with real_if(*args) as captured:
            took_if.append(captured)
            yield captured
    monkeypatch.setattr(_tuning, "graph_if", graph_if)
    hidden, weight, target, b = _inputs((4096,), 256, 8192, torch.bfloat16, "cuda", frac=0.15, bias=True)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    static_t = target.clone()

    def step():
        loss = masked_lm_loss(h, w, static_t, bias=b, backend="triton")
        dh, dw = torch.autograd.grad(loss, [h, w])
        return loss, torch.cat([dh, dw])

    def eager_step():
        with monkeypatch.context() as mp:
            mp.setattr(mll, "capturing", lambda device=None: True)
            return step()

    _capture_replay_compare(step, eager_step, static_t, (0.15, 0.5, 0.0, 1.0))
    assert "bounded" in path_spy and "dense" not in path_spy
    # IF nodes captured (True) where the CUDA extension is built, the eager blocks launched as issued (False)
    assert (True in took_if) == cuda_built() and False in took_if, took_if
    bound = mll._VALID_SEEN.bound(h.device, 4096)
    assert 614 < bound < 4096 * 0.25 and len(kmod.overflow_blocks(4096, bound)) == 4
    monkeypatch.setattr(mll, "capturing", lambda device=None: True)
    over = _inputs((4096,), 8, 8192, torch.bfloat16, "cuda", frac=0.5)[2]
    assert int((over != IGN).sum()) > bound
    _check(hidden, weight, over, b, reduction="mean")


def _capture_replay_compare(step, eager_step, static_t, fracs):
    """Warm ``step()`` up eagerly on a side stream, capture it in a CUDA graph, then for each target
    density refill ``static_t``, replay, and compare the graph's (loss, dhidden) with ``eager_step()``'s
    bit for bit (0.0: every target ignored)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_loss, g_dh = step()
    for frac in fracs:
        new_t = _inputs(static_t.shape, 8, 8192, torch.bfloat16, "cuda", frac=frac)[2]
        if frac == 0.0:
            new_t.fill_(IGN)
        static_t.copy_(new_t)
        graph.replay()
        torch.cuda.synchronize()
        loss, dh = eager_step()
        torch.testing.assert_close(g_loss, loss, rtol=0, atol=0)
        torch.testing.assert_close(g_dh, dh, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_dense_backward_in_a_cuda_graph(path_spy):
    # dense=True: the causal-LM case captured with the sized backward's kernels (no count on the host),
    # replayed with other targets; equal to the same call run eagerly, and to the reference.
    hidden, weight, target, b = _inputs((2048,), 256, 8192, torch.bfloat16, "cuda", frac=0.95)
    h = hidden.clone().requires_grad_(True)
    static_t = target.clone()

    def step():
        loss = masked_lm_loss(h, weight, static_t, backend="triton", dense=True)
        (dh,) = torch.autograd.grad(loss, [h])
        return loss, dh

    _capture_replay_compare(step, step, static_t, (0.9, 1.0, 0.0))
    assert set(path_spy) == {"dense", "sized"}
    _check(hidden, weight, static_t.clone().copy_(_inputs((2048,), 256, 8192, torch.bfloat16, "cuda",
                                                          frac=0.9)[2]), reduction="mean", dense=True)


@pytest.mark.gpu
def test_gpu_captured_causal_lm_takes_the_dense_backward(path_spy):
    # The default call (no dense, no max_valid) captured after an eager warm-up with nearly every target valid (a
    # causal LM): the captured backward is the dense one (faster there than the graph-safe one), replayed with other
    # densities, every target ignored included; bit for bit the same call with dense=True run eagerly.
    hidden, weight, target, _ = _inputs((2048,), 256, 8192, torch.bfloat16, "cuda", frac=0.95)
    h = hidden.clone().requires_grad_(True)
    static_t = target.clone()

    def step(dense=False):
        loss = masked_lm_loss(h, weight, static_t, backend="triton", dense=dense)
        (dh,) = torch.autograd.grad(loss, [h])
        return loss, dh

    _capture_replay_compare(step, lambda: step(dense=True), static_t, (0.9, 0.15, 1.0, 0.0))
    assert set(path_spy) == {"sized", "dense"}  # (the eager warm-up: sized; the capture and the eager checks: dense)


@pytest.mark.gpu
def test_gpu_int64_offsets():
    # hidden has more than 2**31 elements; the valid rows sit past row 2**31 / H, so a kernel that
    # multiplies a 32-bit row index by the row stride would read the wrong rows.
    h_dim, v = 1024, 512
    n = (1 << 31) // h_dim + 64
    hidden = torch.randn(n, h_dim, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(v, h_dim, device="cuda", dtype=torch.bfloat16) * h_dim**-0.5
    target = torch.full((n,), IGN, device="cuda")
    pos = torch.cat([torch.arange(0, 16, device="cuda"), torch.arange(n - 48, n, device="cuda")])
    target[pos] = torch.randint(0, v, (pos.numel(),), device="cuda")
    h = hidden.requires_grad_(True)
    loss = masked_lm_loss(h, weight, target, reduction="none", backend="triton")
    (dh,) = torch.autograd.grad(loss, [h], torch.ones_like(loss))
    sub = hidden.detach()[pos].double()
    ref = F.cross_entropy(sub @ weight.double().t(), target[pos], reduction="none")
    assert max_err(loss[pos], ref) < 0.05
    assert (loss[target == IGN] == 0).all()
    p = torch.softmax(sub @ weight.double().t(), -1)
    p[torch.arange(pos.numel(), device="cuda"), target[pos]] -= 1
    assert max_err(dh[pos], p @ weight.double()) < 0.02
    dh[pos] = 0
    assert dh.abs().max().item() == 0.0


def test_compact_rows_lists_valid_positions_in_order(device):
    from pykernels.masked_lm_loss import compact_rows
    target = torch.tensor([5, IGN, 0, IGN, IGN, 7, 2], device=device)
    rows, count = compact_rows(target, IGN)
    assert rows.dtype == torch.int32 and count.dtype == torch.int32 and rows.shape == (7,) and count.shape == (1,)
    assert count.item() == 4
    assert rows[:4].tolist() == [0, 2, 5, 6]
    assert ((rows[4:] >= 0) & (rows[4:] < 7)).all()  # unused entries still address a valid row
    rows, count = compact_rows(torch.full((5,), IGN, device=device), IGN)
    assert count.item() == 0 and (rows == 0).all()
    rows, count = compact_rows(torch.empty(0, dtype=torch.long, device=device), IGN)
    assert count.item() == 0 and rows.numel() == 0


@pytest.mark.parametrize("n,frac", [(1, 1.0), (37, 0.3), (37, 0.0), (37, 1.0), (100, 0.5), (161, 0.15)])
def test_compaction_kernel_equals_torch_compaction(device, n, frac):
    # several programs (16 positions each on CPU, 1024 on the GPU), each counting the targets before its slice
    from pykernels.masked_lm_loss import compact_rows
    target = torch.randint(0, 50, (n,), device=device)
    target[torch.rand(n, device=device) >= frac] = IGN
    rows, count, loss, lse = kmod.compact(target, IGN)
    want_rows, want_count = compact_rows(target, IGN)
    assert torch.equal(count, want_count)
    assert torch.equal(rows, want_rows)  # the unused tail too (zeros)
    assert torch.equal(loss, torch.zeros_like(loss)) and torch.equal(lse, torch.zeros_like(lse))


@pytest.mark.gpu
@pytest.mark.parametrize("n,frac", [(16384, 0.15), (8192, 1.0), (1 << 16, 0.15), (5000, 0.0), (1025, 0.5)])
def test_gpu_compaction_kernel_at_scale(n, frac):
    from pykernels.masked_lm_loss import compact_rows
    target = torch.randint(0, 30522, (n,), device="cuda")
    target[torch.rand(n, device="cuda") >= frac] = IGN
    rows, count, loss, lse = kmod.compact(target, IGN)
    want_rows, want_count = compact_rows(target, IGN)
    assert torch.equal(count, want_count) and torch.equal(rows, want_rows)
    assert torch.equal(loss, torch.zeros_like(loss)) and torch.equal(lse, torch.zeros_like(lse))


@pytest.mark.parametrize("dz", [False, True], ids=["forward", "dz"])
def test_sm90_logits_launch_binds_the_kernel_signature(monkeypatch, dz):
    # The Gluon kernel runs only on an H100/H200; its host side runs here: every launch argument must land on
    # the kernel parameter of that name (a reordered signature would otherwise show only on the GPU), with the
    # grid and constexprs the sized backward and the forward need, and host TMA descriptors over the rows, the
    # weight and (dz) the chunk's output, clipped to (n_rows, VC).
    from pykernels._kernels import masked_lm_loss_sm90 as sm90
    calls = []

    class _Fake:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))
    monkeypatch.setattr(sm90._launch, "fast", lambda kernel: _Fake())
    monkeypatch.setattr(sm90._tuning, "ensure_allocator", lambda: None)
    monkeypatch.setattr(sm90._tuning, "device_properties", lambda dev: type("P", (), {"multi_processor_count": 132}))
    n, h, v, m = 700, 64, 1000, 300
    hc = torch.zeros(n, h, dtype=torch.bfloat16)
    weight = torch.zeros(v, h + 8, dtype=torch.bfloat16)[:, :h]  # distinct strides, so that a swap shows
    bias = torch.zeros(2 * v, dtype=torch.bfloat16)[::2]
    target = torch.zeros(n, dtype=torch.long)
    rows = torch.zeros(n, dtype=torch.int32)
    count = torch.zeros(1, dtype=torch.int32)
    lse = torch.zeros(n)
    grad = torch.zeros(3 * n)[::3]
    parts = [torch.zeros(8, n) for _ in range(4)]
    out = torch.zeros(m, 264, dtype=torch.bfloat16)
    launch = sm90.logits(hc, weight, bias, target, rows, count, lse, grad, None if dz else parts, n=n,
                         n_rows=m if dz else -1, label_smoothing=0.1, dz=dz, capacity=dz)
    launch(out if dz else None, 256 if dz else 0, 264 if dz else v)
    (grid, args, kwargs), = calls
    names = sm90._logits_sm90_kernel.arg_names
    bound = dict(zip(names, args))
    assert not set(bound) & set(kwargs) and set(bound) | set(kwargs) == set(names) | {"maxnreg"}
    bound.update(kwargs)
    bm, bn, bk, _ = sm90.DZ_CONFIG if dz else sm90.FWD_CONFIG
    a_desc, w_desc = bound["a_desc"], bound["w_desc"]
    assert a_desc.base is hc and (a_desc.shape, a_desc.strides, a_desc.block_shape) == ([n, h], [h, 1], [bm, bk])
    assert w_desc.base is weight and (w_desc.shape, w_desc.strides, w_desc.block_shape) == ([v, h], [h + 8, 1],
                                                                                            [bn, bk])
    assert bound["b_ptr"] is bias
    assert bound["tgt_ptr"] is target and bound["rows_ptr"] is rows and bound["count_ptr"] is count
    assert (bound["N"], bound["V"], bound["H"], bound["R"]) == (n, v, h, n)
    assert (bound["lda"], bound["stride_wv"], bound["stride_b"]) == (h, h + 8, 2)
    assert bound["smooth_eps"] == 0.1 and bound["SMOOTH"] and bound["HAS_BIAS"] and bound["DZ"] == dz
    cfg = sm90.DZ_CONFIG if dz else sm90.FWD_CONFIG
    assert (bound["BLOCK_M"], bound["BLOCK_N"], bound["BLOCK_K"], bound["STAGES"]) == cfg
    assert bound["num_warps"] == 4 and bound["maxnreg"] == sm90.MAX_REGS
    if dz:
        o_desc = bound["out_desc"]
        assert o_desc.base is out and (o_desc.shape, o_desc.strides, o_desc.block_shape) == ([m, 264], [264, 1],
                                                                                            [bm, bn])
        assert bound["ldo"] == 264 and bound["lse_ptr"] is lse
        assert bound["gloss_ptr"] is grad and bound["stride_g"] == 3
        assert (bound["v_off"], bound["VC"], bound["n_rows"], bound["capacity"]) == (256, 264, m, 1)
        tiles = -(-m // 128) * -(-264 // 128)
    else:
        assert bound["out_desc"] is a_desc  # (a placeholder the forward never reads)
        assert all(bound[k] is parts[i] for k, i in (("part_m_ptr", 0), ("part_s_ptr", 1), ("part_zsum_ptr", 3)))
        assert (bound["v_off"], bound["VC"], bound["n_rows"], bound["capacity"]) == (0, v, -1, 0)
        tiles = -(-n // 128) * -(-v // 128)  # (sized for all N rows: the count stays on the device)
    assert grid == (min(132, tiles),) and bound["NUM_PROGRAMS"] == grid[0]
    # the dz epilogue masks columns only in a chunk that reaches past V (past VC the TMA store clips)
    assert bound["COL_MASK"] is False
    if dz:
        launch(out, v - 200, 264)  # the last chunk, padded past V
        assert calls[-1][2]["COL_MASK"] is True and calls[-1][1][names.index("v_off")] == v - 200


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon logits kernel is sm_90's (Hopper)")
@pytest.mark.parametrize("n,h,v,frac,bias,ls", [
    (300, 64, 517, 0.5, True, 0.1),       # one row block, the last chunk's columns past V
    (2000, 768, 30522, 0.15, False, 0.0),  # BERT-like rows (3 row blocks, the last partial)
    (513, 128, 1000, 1.0, True, 0.0),      # every row valid, 5 row blocks
])
def test_gpu_sm90_logits_kernel_equals_the_triton_kernel(n, h, v, frac, bias, ls):
    # kernels/masked_lm_loss_sm90.py takes _logits_tma_kernel's place on sm_90 (the backward's dz and the
    # forward's statistics): the same partials and dz, chunk by chunk, with the host count, with a bound above
    # the count (rows past it 0) and with a wrong host count (NaN in every used column)
    from pykernels._kernels import masked_lm_loss_sm90 as sm90
    hidden, weight, target, b = _inputs((n,), h, v, torch.bfloat16, "cuda", frac=frac, bias=bias)
    rows, count, _, _ = kmod.compact(target, IGN)
    m = int(count.item())
    hc = kmod.gather_rows(hidden, rows, count)
    assert kmod._sm90(hidden, True)  # the package's choice for the sized backward on this card
    # forward: per-tile max and sum-exp (and the row sum with smoothing), 128 columns a tile in both kernels
    split = -(-v // sm90.FWD_CONFIG[1])
    assert split == -(-v // kmod.TMA_FWD_CONFIG[1])
    lse = torch.zeros(n, device="cuda")
    got, want = ([torch.full((split, n), float("nan"), device="cuda") for _ in range(4)] for _ in range(2))
    sm90.logits(hc, weight, b, target, rows, count, lse, lse, got, n=n, n_rows=-1, label_smoothing=ls,
                dz=False)(None, 0, v)
    kmod._logits_tma(hc, weight, b, target, rows, count, lse, lse, want, n=n, n_rows=-1, label_smoothing=ls,
                     cfg=kmod.TMA_FWD_CONFIG, dz=False, zt=False)(None, 0, v)
    for i in ((0, 1, 3) if ls > 0 else (0, 1)):
        assert torch.isfinite(got[i][:, :m]).all()
        torch.testing.assert_close(got[i][:, :m], want[i][:, :m], rtol=1e-5, atol=1e-5)
    # dz in two chunks (the second padded to 8 columns, past V at V = 517)
    _, lse = kmod.masked_lm_loss_fwd(hidden, weight, target, b, rows, count, label_smoothing=ls)
    g = torch.rand(n, device="cuda") + 0.5
    first = 256 if v < 2000 else 7680
    # (a bound up to 300 rows above the count, at most N as the op allows (the kernels read rows[:n_rows]; a
    # bound past N read past the compacted rows, and a garbage row index faulted in run173-174); the rows as the
    # sized backward gathers them: n_rows of them, zero past the count under a bound)
    for n_rows, capacity in ((m, False), (min(m + 300, n), True), (max(m - 1, 1), False)):
        hc_b = kmod.gather_rows(hidden, rows, count, n_rows, zero_tail=capacity)
        for v_off, vc in ((0, first), (first, -(-(v - first) // 8) * 8)):
            outs = []
            for launch in (sm90.logits(hc_b, weight, b, target, rows, count, lse, g, None, n=n, n_rows=n_rows,
                                       label_smoothing=ls, dz=True, capacity=capacity),
                           kmod._logits_tma(hc_b, weight, b, target, rows, count, lse, g, None, n=n,
                                            n_rows=n_rows, label_smoothing=ls, cfg=kmod.TMA_DZ_CONFIG, dz=True,
                                            capacity=capacity)):
                d = torch.full((n_rows, vc), float("nan"), device="cuda", dtype=torch.bfloat16)
                launch(d, v_off, vc)
                outs.append(d[:, :min(vc, v - v_off)].float())
            got_d, want_d = outs
            if n_rows != m and not capacity:
                assert torch.isnan(got_d).all() and torch.isnan(want_d).all()
                continue
            assert torch.isfinite(got_d).all()
            torch.testing.assert_close(got_d, want_d, rtol=0.01, atol=1e-6)
            assert (got_d[m:] == 0).all()  # rows past the device count (the bound's extra rows)
    # the op launches it through the fast launcher (the JIT's own path costs 60-85 us of host time a launch on
    # the GPU machines' hosts: 22 chunks at GPT-2)
    from pykernels._kernels import _launch
    before = _launch.stats(sm90._logits_sm90_kernel)[0]
    for _ in range(2):
        masked_lm_loss(hidden.requires_grad_(), weight, target, bias=b, label_smoothing=ls).backward()
    assert _launch.stats(sm90._logits_sm90_kernel)[0] > before


@pytest.mark.parametrize("covers_all", [False, True])
@pytest.mark.parametrize("n_tail", [0, 1, 7])
def test_scatter_rows_adds_the_tail(device, covers_all, n_tail):
    # The sized backward's last step: dhidden[rows[i]] = acc[i] + tail_dz[i] @ tail_w in fp32, cast once; 0 at
    # ignored positions, or (covers_all: every position a row, as where every target is valid) no zero fill
    # and no programs for ignored positions. dhidden is NaN-poisoned first: every position must be written.
    n, h = 37, 40
    if covers_all:
        target = torch.randint(0, 50, (n,), device=device)
    else:
        target = torch.where(torch.rand(n, device=device) < 0.4, torch.randint(0, 50, (n,), device=device), IGN)
        target[3] = 5
    rows, count, _, _ = kmod.compact(target, IGN)
    m = int(count.item())
    acc = torch.randn(m, h, device=device)
    tail = None
    want = torch.zeros(n, h, device=device, dtype=torch.float64)
    add = torch.zeros(m, h, device=device, dtype=torch.float64)
    if n_tail:
        dt = torch.randn(m, n_tail, device=device, dtype=torch.float16)
        wt = torch.randn(n_tail, h, device=device, dtype=torch.float16)
        tail = (dt, wt)
        add = dt.double() @ wt.double()
    want[rows[:m].long()] = acc.double() + add
    dh = torch.full((n, h), float("nan"), device=device, dtype=torch.float16)
    kmod.scatter_rows(acc, rows, count, target, dh, IGN, tail=tail, covers_all=covers_all)
    torch.testing.assert_close(dh.double(), want.to(torch.float16).double(), rtol=2e-3, atol=2e-3)
    assert (dh[target == IGN] == 0).all()
    if not covers_all:
        with pytest.raises(ValueError, match="covers_all"):
            kmod.scatter_rows(acc, rows, count, target, dh, IGN, covers_all=True)


def test_long_inputs_use_the_torch_compaction(device, monkeypatch):
    # Past COMPACT_KERNEL_MAX_N positions the kernel (each program reads every target) would be slow: torch's
    # scan is used, with the same results.
    monkeypatch.setattr(kmod, "COMPACT_KERNEL_MAX_N", 16)
    assert kmod.compact(torch.zeros(37, dtype=torch.long, device=device), IGN) is None
    hidden, weight, target, b = _inputs((37,), 32, 517, torch.float32, device, frac=0.3, bias=True)
    _check(hidden, weight, target, b, reduction="sum")


@pytest.mark.parametrize("which", ["hidden", "weight", "bias"])
def test_gradient_of_one_input_only(device, which, monkeypatch):
    # The backward skips the dW or dhidden programs that no input needs; the others stay exact.
    monkeypatch.setattr(kmod, "DLOGITS_BUDGET_BYTES", 37 * 4 * 256)  # three chunks
    hidden, weight, target, b = _inputs((37,), 32, 517, torch.float32, device, frac=0.4, bias=True)
    ins = {"hidden": hidden.clone(), "weight": weight.clone(), "bias": b.clone()}
    ins[which].requires_grad_(True)
    loss = masked_lm_loss(ins["hidden"], ins["weight"], target, bias=ins["bias"], backend="triton")
    (got,) = torch.autograd.grad(loss, [ins[which]])
    ref = {k: v.double().requires_grad_(k == which) for k, v in ins.items()}
    ref_loss = masked_lm_loss_reference(ref["hidden"], ref["weight"], target, bias=ref["bias"])
    (want,) = torch.autograd.grad(ref_loss, [ref[which]])
    assert max_err(got, want) < 1e-5


@pytest.mark.parametrize("which", ["hidden", "weight", "bias"])
def test_bounded_backward_gradient_of_one_input_only(device, which, monkeypatch, path_spy):
    # The bounded backward (captured, simulated) with rows past its bound and several chunks in both passes, one input
    # needing a gradient: each pass skips the programs no input needs, and the other gradient comes out exact.
    monkeypatch.setattr(kmod, "DLOGITS_BUDGET_BYTES", 37 * 4 * 256)  # three chunks in the graph-safe pass
    monkeypatch.setattr(kmod, "SIZED_DLOGITS_BUDGET_BYTES", 1)  # and in the capacity pass
    hidden, weight, target, b = _inputs((37,), 32, 517, torch.float32, device, frac=0.6, bias=True)
    m = int((target != IGN).sum())
    _simulate_bounded_capture(monkeypatch, max(m - 7, 1))
    ins = {"hidden": hidden.clone(), "weight": weight.clone(), "bias": b.clone()}
    ins[which].requires_grad_(True)
    loss = masked_lm_loss(ins["hidden"], ins["weight"], target, bias=ins["bias"], backend="triton")
    (got,) = torch.autograd.grad(loss, [ins[which]])
    assert path_spy == ["bounded", "sized", "graph-safe"]
    ref = {k: v.double().requires_grad_(k == which) for k, v in ins.items()}
    ref_loss = masked_lm_loss_reference(ref["hidden"], ref["weight"], target, bias=ref["bias"])
    (want,) = torch.autograd.grad(ref_loss, [ref[which]])
    assert max_err(got, want) < 1e-5


# ---- max_valid: the sized backward for an upper bound of the count, no wait ------------------------------

@pytest.mark.parametrize("dtype,bias,reduction,ls,extra", [
    (torch.float32, False, "mean", 0.0, 0), (torch.float32, True, "none", 0.1, 5),
    (torch.float16, True, "sum", 0.0, 3), (torch.float16, False, "mean", 0.2, 1000)])
def test_max_valid_matches_reference(device, monkeypatch, path_spy, dtype, bias, reduction, ls, extra):
    # max_valid = the count (+ extra): the sized backward with zero rows past the count (a bound of N or more:
    # the dense backward), and no count copy to the host (nothing would wait for it)
    monkeypatch.setattr(_P._COUNTS, "start", lambda count: pytest.fail("max_valid must not copy the count"))
    hidden, weight, target, b = _inputs((2, 19), 32, 517, dtype, device, frac=0.3, bias=bias)
    count = int((target != IGN).sum())
    out = _check(hidden, weight, target, b, reduction=reduction, label_smoothing=ls, max_valid=count + extra)
    assert path_spy == (["dense", "sized"] if count + extra >= 38 else ["sized"])
    assert (out[1][target == IGN] == 0).all()


def test_max_valid_with_chunks_every_row_valid_and_none_valid(device, monkeypatch, path_spy):
    monkeypatch.setattr(kmod, "SIZED_DLOGITS_BUDGET_BYTES", 1)  # several vocabulary chunks
    hidden, weight, target, b = _inputs((37,), 32, 700, torch.float16, device, frac=0.4, bias=True)
    _check(hidden, weight, target, b, reduction="sum", max_valid=30)
    full = _inputs((37,), 32, 700, torch.float16, device, frac=1.0)[2]
    assert (full != IGN).all()
    _check(hidden, weight, full, b, reduction="mean", max_valid=37)  # every row valid: a bound of N, dense
    assert path_spy == ["sized", "dense", "sized"]
    none = torch.full_like(target, IGN)
    loss, dh, dw, db = _run(lambda h, w, bias: masked_lm_loss(h, w, none, bias=bias, backend="triton", max_valid=8),
                            hidden, weight, b, None)
    assert loss.item() == 0 and not dh.any() and not dw.any() and not db.any()
    empty = torch.zeros(0, dtype=torch.long, device=device)  # no positions at all
    loss, dh, dw, db = _run(lambda h, w, bias: masked_lm_loss(h, w, empty, bias=bias, backend="triton", max_valid=8),
                            hidden[:0], weight, b, None)
    assert loss.item() == 0 and dh.shape == (0, 32) and not dw.any() and not db.any()


def test_max_valid_below_the_count_gives_nan_gradients(device):
    # More valid targets than max_valid: the loss is still right, the gradients NaN (never partial)
    hidden, weight, target, b = _inputs((37,), 32, 517, torch.float16, device, frac=0.5, bias=True)
    count = int((target != IGN).sum())
    assert count >= 3
    loss, dh, dw, db = _run(lambda h, w, bias: masked_lm_loss(h, w, target, bias=bias, backend="triton",
                                                             max_valid=count - 2), hidden, weight, b, None)
    ref = masked_lm_loss_reference(hidden.double(), weight.double(), target, bias=b.double())
    assert abs(loss.item() - ref.item()) < 1e-2 * abs(ref.item())
    assert torch.isnan(dw).all() and torch.isnan(db).all()
    assert torch.isnan(dh[target != IGN]).all() and (dh[target == IGN] == 0).all()


def test_max_valid_bad_values(device):
    hidden, weight, target, _ = _inputs((37,), 32, 517, torch.float32, device)
    for bad, err in ((0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError), ("8", TypeError)):
        with pytest.raises(err, match="max_valid"):
            masked_lm_loss(hidden, weight, target, max_valid=bad, backend="triton")
    for kw in (dict(dense=True), dict(graph_safe=True)):
        with pytest.raises(ValueError, match="max_valid"):
            masked_lm_loss(hidden, weight, target, max_valid=8, backend="triton", **kw)


# ---- the eager lane: op and reduction in one autograd node --------------------------------------------

_P = __import__("sys").modules["pykernels.masked_lm_loss"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction,num_valid,bias,ls", [
    ("mean", None, True, 0.0), ("mean", 23, False, 0.1), ("mean", "tensor", True, 0.0),
    ("sum", None, False, 0.0), ("none", None, True, 0.2), ("mean", None, True, "z_loss")])
def test_eager_lane_equals_op_path(device, monkeypatch, mode, reduction, num_valid, bias, ls):
    # The lane (default for plain eager calls) and the registered op plus torch's reduction: loss and
    # every gradient bit for bit equal, with a (2, 19) target and strided hidden; the lane's node is the
    # loss's grad_fn.
    hidden, weight, target, b = _inputs((2, 19), 32, 517, torch.float16, device, frac=0.3, bias=bias)
    hidden = torch.randn(19, 2, 48, device=device, dtype=torch.float16).transpose(0, 1)[..., 8:40]
    nv = torch.tensor(23.0, device=device) if num_valid == "tensor" else num_valid
    grad_out = torch.randn(target.shape, device=device) if reduction == "none" else None
    z_loss, ls = (0.01, 0.1) if ls == "z_loss" else (0.0, ls)
    kw = dict(reduction=reduction, num_valid=nv, label_smoothing=ls, z_loss=z_loss, backend="triton", **MODES[mode])
    f = lambda h, w, bias: masked_lm_loss(h, w, target, bias=bias, **kw)  # noqa: E731
    nodes = []
    real_apply = _P._EagerLoss.apply
    monkeypatch.setattr(_P._EagerLoss, "apply", lambda *a: (nodes.append(1), real_apply(*a))[1])
    lane = _run(f, hidden, weight, b, grad_out)
    assert len(nodes) == 1
    monkeypatch.setattr(_P, "_LANE_ON", False)
    full = _run(f, hidden, weight, b, grad_out)
    assert len(nodes) == 1
    for x, y in zip(lane, full):
        assert x.shape == y.shape and x.dtype == y.dtype
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    with torch.no_grad():
        torch.testing.assert_close(f(hidden, weight, b), full[0], rtol=0, atol=0)


def test_eager_lane_backward_paths(device, monkeypatch):
    hidden, weight, target, b = _inputs((37,), 32, 517, torch.float32, device, frac=0.3, bias=True)
    h = hidden.clone().requires_grad_(True)
    loss = masked_lm_loss(h, weight, target, bias=b, backend="triton")
    assert type(loss.grad_fn).__name__ == "_EagerLossBackward"
    # create_graph: the backward runs through the registered backward op, which has no gradient itself:
    # a second backward raises instead of silently missing a term
    (dh,) = torch.autograd.grad(loss, [h], create_graph=True)
    ref = _run(lambda h, w, bias: masked_lm_loss(h, w, target, bias=bias, backend="triton"), hidden, weight, b,
               None)[1]
    torch.testing.assert_close(dh.detach(), ref, rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        dh.sum().backward()
    # a num_valid that needs a gradient, and a tracing context, take the op path
    nv = torch.tensor(23.0, device=device, requires_grad=True)
    loss = masked_lm_loss(h, weight, target, bias=b, backend="triton", num_valid=nv)
    assert type(loss.grad_fn).__name__ == "DivBackward0"
    loss.backward()
    assert nv.grad is not None
    monkeypatch.setattr(_P, "_LANE_ON", False)
    assert type(masked_lm_loss(h, weight, target, backend="triton").grad_fn).__name__ == "DivBackward0"


# ---- CUDA C++ backend (csrc/masked_lm_loss.cu): built on the GPU machine only ---------------------------


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("n,h,v,frac,bias,reduction,ls", [
    (4096, 768, 30522, 0.15, True, "mean", 0.0),     # BERT-base-like, several vocabulary chunks
    (2048, 1024, 30522, 0.15, False, "sum", 0.1),
    (1024, 768, 50257, 1.0, False, "mean", 0.0),     # causal LM: every position
    (37, 32, 517, 0.3, True, "none", 0.2),
    (300, 64, 1, 0.5, True, "mean", 0.0),            # V = 1: exactly zero gradients
    (127, 96, 1000, 0.2, False, "none", 0.0),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_cuda_backend(n, h, v, frac, bias, reduction, ls, dtype):
    hidden, weight, target, b = _inputs((n,), h, v, dtype, "cuda", frac=frac, bias=bias)
    _check(hidden, weight, target, b, reduction=reduction, label_smoothing=ls, backend="cuda")


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_cuda_backend_edges():
    # all ignored: loss 0 and zero gradients; num_valid (int, float and tensor); a strided 3-D hidden; one input's
    # gradient only; out-of-range targets: NaN loss, the plain softmax's gradient (as the Triton path)
    hidden, weight, target, b = _inputs((4, 50), 64, 517, torch.bfloat16, "cuda", frac=0.3, bias=True)
    for reduction in ("mean", "sum", "none"):
        none = torch.full_like(target, IGN)
        out = _run(lambda h_, w_, bias: masked_lm_loss(h_, w_, none, bias=bias, reduction=reduction, backend="cuda"),
                   hidden, weight, b, torch.ones(none.shape, device="cuda") if reduction == "none" else None)
        for x in out:
            assert torch.equal(x, torch.zeros_like(x))
    for nv in (7, 2.5, torch.tensor(7.0, device="cuda")):
        _check(hidden, weight, target, b, num_valid=nv, backend="cuda")
    strided = torch.randn(4, 100, 64, device="cuda", dtype=torch.bfloat16)[:, ::2]
    _check(strided, weight, target, b, reduction="none", backend="cuda")
    w = weight.clone().requires_grad_()
    h = hidden.clone()  # no gradient wanted for hidden
    (gw,) = torch.autograd.grad(masked_lm_loss(h, w, target, backend="cuda"), [w])
    (gw_t,) = torch.autograd.grad(masked_lm_loss(h, w, target, backend="triton"), [w])
    torch.testing.assert_close(gw, gw_t, rtol=2e-2, atol=1e-4)
    bad = target.clone().reshape(-1)
    bad[0], bad[1] = 517, -5
    x = hidden.reshape(-1, 64).clone().requires_grad_()
    rows = masked_lm_loss(x, weight, bad, reduction="none", backend="cuda")
    assert torch.isnan(rows[:2]).all() and torch.isfinite(rows[2:]).all()
    rows[2:].sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_cuda_backend_routing():
    hidden, weight, target, b = _inputs((256,), 64, 517, torch.bfloat16, "cuda", frac=0.3, bias=True)
    # auto keeps Triton (bitwise the Triton backend's loss); named, the C++ op
    torch.testing.assert_close(masked_lm_loss(hidden, weight, target), masked_lm_loss(hidden, weight, target,
                                                                                      backend="triton"),
                               rtol=0, atol=0)
    for kw in (dict(graph_safe=True), dict(dense=True), dict(max_valid=100)):
        with pytest.raises(BackendUnavailableError, match="host sync"):
            masked_lm_loss(hidden, weight, target, backend="cuda", **kw)
    with pytest.raises(Exception, match="eager mode only"):
        torch.compile(lambda h_: masked_lm_loss(h_, weight, target, backend="cuda"), fullgraph=True,
                      backend="aot_eager")(hidden)


def test_cuda_cover_and_routing_rules(device):
    """The C++ op's cover on any machine: the Triton path's no-wait options and dtypes it declines, with why; it is
    never taken unless named."""
    from pykernels.masked_lm_loss import _cuda_cover, _use_cuda
    import pykernels
    hidden, weight, target, b = _inputs((8,), 16, 33, torch.float32, device, frac=0.5, bias=True)
    assert _cuda_cover(hidden, weight, target, b, False, False, 0, None) is None
    for flags in ((True, False, 0), (False, True, 0), (False, False, 4)):
        assert "host sync" in _cuda_cover(hidden, weight, target, b, *flags, None)
    assert "float64" in _cuda_cover(hidden.double(), weight.double(), target, None, False, False, 0, None)
    for backend in (None, "auto", "triton", "reference"):
        assert not _use_cuda(backend, hidden, weight, target, b, False, False, 0, None)
    if not pykernels.backends()["cuda"].available:
        with pytest.raises(BackendUnavailableError, match="pykernels._C is not built"):
            masked_lm_loss(hidden, weight, target, backend="cuda")
