"""Registered custom ops with an eager fast path.

Every op is a ``torch.library.custom_op`` with a fake impl and autograd, so torch.compile keeps it
in its graph. Dispatching a custom op through the dispatcher and its autograd layer costs tens of
microseconds of host time per call (measured: ~43 us with grad vs ~8 us for an autograd.Function on
this project's CPU machine), which is as long as a LayerNorm kernel runs on an H100. So
:func:`custom_op` returns a :class:`FusedOp` that

* under ``torch.compile`` (``torch.compiler.is_compiling()``) calls the registered op, so the graph
  holds ``pykernels::<name>`` with its fake impl and registered autograd;
* in eager mode calls the same implementation through an ``autograd.Function`` built from the same
  ``setup_context`` and ``backward`` (or directly, when no input needs a gradient). An op without
  autograd (the backward ops) called while gradients are recorded (``create_graph=True``) goes through
  the registered op, which raises if a second backward reaches it: never a silently missing gradient.

Both paths run the same functions: the results are identical, only the dispatch differs.
"""
from __future__ import annotations

import inspect
from typing import Callable, Iterable

import torch


class FusedOp:
    """A custom op (``self.op``) plus its eager fast path. Use like ``torch.library.custom_op``'s
    result: ``register_fake``, ``register_autograd``, and call it."""

    def __init__(self, name: str, impl: Callable, mutates_args: Iterable[str]):
        self.name = name
        self.impl = impl
        self.op = torch.library.custom_op(name, mutates_args=tuple(mutates_args))(impl)
        self._function: type[torch.autograd.Function] | None = None
        params = list(inspect.signature(impl).parameters)
        # positions of mutated arguments: the eager path bumps their version counters as the
        # dispatcher would, so autograd still catches a mutated tensor that a graph saved
        self._mutated = tuple(params.index(a) for a in mutates_args)

    def register_fake(self, fn: Callable) -> Callable:
        self.op.register_fake(fn)
        return fn

    def register_autograd(self, backward: Callable, *, setup_context: Callable,
                          materialize: tuple[int, ...] = (0,)) -> None:
        """``backward`` gets one gradient per output. In the eager path only the outputs listed in
        ``materialize`` get zeros where no gradient arrived (autograd's default fills every output's, and
        the ops' extra outputs (lse, seeds, counts) are never differentiated: that was one allocation and
        one fill kernel per extra output and call, ~50 us of host time each on the H100 machine); the
        others arrive as None, which ``backward`` must accept."""
        self.op.register_autograd(backward, setup_context=setup_context)
        impl = self.impl
        keep = tuple(materialize)

        def forward(ctx, *args):
            out = impl(*args)
            setup_context(ctx, args, out)
            ctx.set_materialize_grads(False)
            if keep:
                outs = out if isinstance(out, tuple) else (out,)
                ctx.pk_like = tuple((outs[i].shape, outs[i].dtype, outs[i].device) for i in keep)
            return out

        def eager_backward(ctx, *grads):
            if keep and any(grads[i] is None for i in keep):
                grads = list(grads)
                for (shape, dtype, device), i in zip(ctx.pk_like, keep):
                    if grads[i] is None:
                        grads[i] = torch.zeros(shape, dtype=dtype, device=device)
            return backward(ctx, *grads)

        self._function = type(self.name.replace("::", "_") + "_function", (torch.autograd.Function,),
                              {"forward": staticmethod(forward), "backward": staticmethod(eager_backward)})

    def __call__(self, *args):
        if not _plain_eager(args):
            return self.op(*args)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            if self._function is not None:
                return self._function.apply(*args)
            # An op without autograd (the backward ops) called where gradients are recorded: a
            # double backward (create_graph=True). The registered op records a node that raises if
            # anything backpropagates through it; the plain impl would give outputs that silently
            # carry no gradient.
            return self.op(*args)
        out = self.impl(*args)
        for i in self._mutated:
            torch.autograd.graph.increment_version(args[i])
        return out


def _plain_eager(args) -> bool:
    """True when the call is plain eager execution on real tensors: not dynamo tracing, no dispatch
    mode (make_fx / AOTAutograd / FakeTensorMode / user modes) active, and no tensor subclass
    (FakeTensor, FunctionalTensor, DTensor...) among the arguments. Anything else goes through the
    registered op, whose fake impl and autograd formula those systems understand."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    return all(type(a) is torch.Tensor or type(a) is torch.nn.Parameter
               for a in args if isinstance(a, torch.Tensor))


def custom_op(name: str, *, mutates_args: Iterable[str] = ()) -> Callable[[Callable], FusedOp]:
    """Decorator: ``@custom_op("pykernels::x_fwd")`` over the implementation function (typed like
    ``torch.library.custom_op`` wants it)."""
    def wrap(impl: Callable) -> FusedOp:
        return FusedOp(name, impl, mutates_args)
    return wrap
