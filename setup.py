"""Build pykernels.

The Triton kernels in ``kernels/`` install as the private package ``pykernels._kernels`` (never as a
top-level ``kernels``, which would shadow Hugging Face's ``kernels`` package). The CUDA C++ sources
in ``csrc/`` build the extension ``pykernels._C`` with ninja when there are sources to build, a CUDA
toolkit, and either a visible GPU or ``FORCE_CUDA=1``; ``PYKERNELS_SKIP_CUDA_BUILD=1`` skips it.
Environment: ``TORCH_CUDA_ARCH_LIST`` (default "9.0a": H100 / H200, with the attention forward's wgmma kernel;
"9.0" or other lists build without it), ``MAX_JOBS`` (ninja parallelism), ``PYKERNELS_NVCC_FLAGS`` (extra flags for both
compilers, for development builds, e.g. "-DPYKERNELS_FWD_TRACE": benchmarks/dev/attention_fwd_trace.py).
Building the extension needs torch at build time: ``pip install --no-build-isolation -e .``.
"""
import glob
import os

from setuptools import setup


def _cuda_extensions():
    sources = sorted(glob.glob("csrc/**/*.cu", recursive=True) + glob.glob("csrc/**/*.cpp", recursive=True))
    if not sources or os.environ.get("PYKERNELS_SKIP_CUDA_BUILD") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return [], {}
    if CUDA_HOME is None or not (torch.cuda.is_available() or os.environ.get("FORCE_CUDA") == "1"):
        return [], {}
    # sm_90a: the Hopper-only instructions (wgmma) of the attention forward; other lists build without them
    arch_list = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    flags = ["-DPYKERNELS_SM90A"] if "9.0a" in arch_list.replace(" ", ";").split(";") else []
    flags += os.environ.get("PYKERNELS_NVCC_FLAGS", "").split()
    ext = CUDAExtension(
        name="pykernels._C",
        sources=sources,
        include_dirs=[os.path.abspath("csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"] + flags,
                            "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"] + flags},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _cuda_extensions()

setup(
    name="pykernels",
    version="0.1.0",
    description="Fused Triton and CUDA kernels for BERT- and GPT-style pretraining",
    python_requires=">=3.10",
    packages=["pykernels", "pykernels.integrations", "pykernels.nn", "pykernels._kernels"],
    package_dir={"pykernels._kernels": "kernels"},
    install_requires=["torch>=2.11", "triton>=3.6,<3.7; platform_system=='Linux'"],
    extras_require={"test": ["pytest", "pytest-benchmark", "hypothesis", "transformers", "safetensors"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
