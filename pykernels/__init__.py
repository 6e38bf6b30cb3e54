"""pykernels: fused Triton (and CUDA C++) kernels for BERT- and GPT-style pretraining.

Ops (each a registered torch custom op with autograd, so ``torch.compile(fullgraph=True)`` keeps it
in its graph; each takes ``backend="auto" | "triton" | "cuda" | "reference"``):

* :func:`scaled_dot_product_attention`, :func:`varlen_attention` (+ :func:`unpad_input`, :func:`pad_input`)
* :func:`layer_norm` (residual add + LayerNorm/RMSNorm, post-LN and pre-LN)
* :func:`cross_entropy` and :func:`masked_lm_loss` (LM head + loss only at the labelled positions)

Backends: :func:`backends` says which are available here and why not; :func:`use_backend` sets the
default for a block.
"""
from ._backend import (BackendInfo, BackendUnavailableError, FallbackWarning, PerformanceWarning, backends,
                       default_backend, use_backend)
from .attention import pad_input, scaled_dot_product_attention, unpad_input, varlen_attention
from .cross_entropy import cross_entropy
from .layer_norm import layer_norm
from .masked_lm_loss import masked_lm_loss, shift_labels
from . import nn  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "scaled_dot_product_attention", "varlen_attention", "unpad_input", "pad_input",
    "layer_norm", "cross_entropy", "masked_lm_loss", "shift_labels", "nn",
    "backends", "use_backend", "default_backend", "BackendInfo", "BackendUnavailableError", "FallbackWarning",
    "PerformanceWarning",
]
