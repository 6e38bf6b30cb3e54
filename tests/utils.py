"""The three-way tolerance rule of DEVELOPERS.md.

A fused kernel's error against a high-precision reference (float64) must be at most ``factor`` (2)
times the error of PyTorch's own eager op in the same dtype against that reference, plus a small
``atol``.
"""
from __future__ import annotations

import pytest
import torch


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_close_to_ref(name: str, out: torch.Tensor, ref_hi: torch.Tensor, ref_lo: torch.Tensor,
                        *, factor: float = 2.0, atol: float = 1e-5, ulp: bool = False) -> None:
    """``out``: the kernel's result; ``ref_hi``: reference in float64; ``ref_lo``: reference in the
    same dtype as the kernel's inputs. ``ulp``: each element may also differ by one unit in the last place of
    ``out``'s dtype at its magnitude (for results rounded once from an fp32 sum, such as a LayerNorm's dweight
    and dbias over thousands of rows: where the exact sum lies within the fp32 sum's error of a rounding boundary
    the two round to neighbours, whatever the eager op happened to do on the same data)."""
    assert out.shape == ref_hi.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref_hi.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values in output"
    base = max_err(ref_lo, ref_hi)
    if ulp and out.numel() and out.is_floating_point():
        diff = (out.double() - ref_hi.double()).abs()
        slack = ref_hi.double().abs() * torch.finfo(out.dtype).eps
        excess = (diff - slack).max().item()
        assert excess <= factor * base + atol, (
            f"{name}: max error beyond one ulp {excess:.3e} exceeds {factor} x eager error {base:.3e} + atol "
            f"{atol:.1e}")
        return
    err = max_err(out, ref_hi)
    assert err <= factor * base + atol, (
        f"{name}: max error {err:.3e} exceeds {factor} x eager error {base:.3e} + atol {atol:.1e}")


def cuda_built() -> bool:
    """Whether the CUDA C++ extension (``pykernels._C``) is built and importable here."""
    import pykernels
    return pykernels.backends()["cuda"].available


# GPU tests of the CUDA C++ backend: they skip on CPU and where the extension is not built
needs_cuda_ext = pytest.mark.skipif(not torch.cuda.is_available() or not cuda_built(),
                                    reason="needs a CUDA device and the built extension pykernels._C")


def load_benchmark(name: str):
    """A ``benchmarks/<name>.py`` script as a module (for the CPU tests of their plumbing): yields it registered
    in ``sys.modules`` (its dataclasses look their module up there) and unregisters it afterwards. Use as the body
    of a module-scoped fixture: ``yield from load_benchmark("attention")`` (``"dev/cuda_sass"`` for a dev script), or
    through ``contextlib.contextmanager``."""
    import importlib.util
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(f"bench_{name.replace('/', '_')}",
                                                  os.path.join(root, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)
