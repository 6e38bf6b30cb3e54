"""Modules over the pykernels ops."""
from .layer_norm import LayerNorm, RMSNorm, replace_layer_norms

__all__ = ["LayerNorm", "RMSNorm", "replace_layer_norms"]
