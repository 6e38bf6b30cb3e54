"""FusedOp: the eager fast path and the registered custom op give the same values and gradients,
and torch.compile puts the registered op in its graph."""
import pytest
import torch
from torch import Tensor

import pykernels
from pykernels._op import custom_op


@custom_op("pykernels_test::scale_fwd")
def _scale(x: Tensor, a: float) -> tuple[Tensor, Tensor]:
    return x * a, (x * a).sum(-1)


@_scale.register_fake
def _(x, a):
    return torch.empty_like(x), x.new_empty(x.shape[:-1])


def _setup(ctx, inputs, output):
    ctx.a = inputs[1]
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, gy, gs):
    return gy * ctx.a, None


_scale.register_autograd(_backward, setup_context=_setup)


def test_eager_fast_path_matches_registered_op():
    x = torch.randn(3, 5, requires_grad=True)
    y_fast, s_fast = _scale(x, 2.5)
    assert type(y_fast.grad_fn).__name__.startswith("pykernels_test_scale_fwd_function")
    (g_fast,) = torch.autograd.grad(y_fast.sum(), x)
    y_op, s_op = _scale.op(x, 2.5)
    (g_op,) = torch.autograd.grad(y_op.sum(), x)
    assert torch.equal(y_fast, y_op) and torch.equal(s_fast, s_op) and torch.equal(g_fast, g_op)
    assert not s_fast.requires_grad


def test_no_grad_calls_the_implementation():
    x = torch.randn(4)
    y, _ = _scale(x, 3.0)
    assert y.grad_fn is None and torch.equal(y, x * 3.0)


def test_compile_keeps_the_custom_op_in_the_graph():
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    f = torch.compile(lambda x: _scale(x, 2.0)[0] * 3, fullgraph=True, backend=backend)
    x = torch.randn(2, 3, requires_grad=True)
    y = f(x)
    y.sum().backward()
    assert any("pykernels_test.scale_fwd" in s for s in seen), seen
    assert torch.allclose(x.grad, torch.full_like(x, 6.0))


def test_traced_backward_uses_the_registered_op():
    """AOTAutograd traces the backward with fake/functional tensors: the fast path must not run there
    (it would reach a kernel launch with tensors that have no data)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(3, 4)
        y, s = _scale(x, 2.0)
    assert y.shape == (3, 4) and s.shape == (3,)


@pytest.mark.parametrize("op", ["attention", "cross_entropy", "masked_lm_loss"])
def test_double_backward_raises_never_silent(op, device):
    """A second backward through an op's backward raises (the backward ops have no autograd formula);
    the eager fast path must not hand out a gradient that silently carries none."""
    g = torch.Generator().manual_seed(0)
    if op == "attention":
        q = torch.randn(1, 2, 8, 16, generator=g).to(device).requires_grad_()
        f = lambda t: pykernels.scaled_dot_product_attention(t, t, t, backend="triton")  # noqa: E731
    elif op == "cross_entropy":
        q = torch.randn(4, 10, generator=g).to(device).requires_grad_()
        tgt = torch.tensor([1, 2, 3, 4], device=device)
        f = lambda t: pykernels.cross_entropy(t, tgt, reduction="none", backend="triton")  # noqa: E731
    else:
        q = torch.randn(4, 16, generator=g).to(device).requires_grad_()
        wv = torch.randn(10, 16, generator=g).to(device)
        tgt = torch.tensor([1, -100, 3, 4], device=device)
        f = lambda t: pykernels.masked_lm_loss(t, wv, tgt, reduction="none", backend="triton")  # noqa: E731
    out = f(q)
    (gq,) = torch.autograd.grad((out * out).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        gq.sum().backward()


@custom_op("pykernels_test::pair_fwd")
def _pair(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return x * 2, x * 3, x.sum(-1)


@_pair.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x), x.new_empty(x.shape[:-1])


_PAIR_SEEN: list = []


def _pair_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[2])


def _pair_backward(ctx, ga, gb, gs):
    _PAIR_SEEN.append((ga, gb, gs))
    g = torch.zeros(()) if ga is None else ga * 2
    return g + (0 if gb is None else gb * 3)


_pair.register_autograd(_pair_backward, setup_context=_pair_setup, materialize=(0,))


def test_eager_backward_materializes_only_the_listed_outputs():
    """Extra outputs (lse, seeds, counts) get no zero gradient built for them in the eager path (an
    allocation and a fill per output and call); the listed ones (here output 0) still do."""
    x = torch.randn(3, 4, requires_grad=True)
    _PAIR_SEEN.clear()
    a, b, s = _pair(x)
    a.sum().backward()
    ga, gb, gs = _PAIR_SEEN[-1]
    assert isinstance(ga, Tensor) and gb is None and gs is None
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    x.grad = None
    a, b, s = _pair(x)
    b.sum().backward()  # no gradient reaches output 0: it is materialized as zeros, output 1's arrives
    ga, gb, gs = _PAIR_SEEN[-1]
    assert torch.equal(ga, torch.zeros_like(x)) and isinstance(gb, Tensor) and gs is None
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))

