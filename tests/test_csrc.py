"""The CUDA C++ sources compile for sm_90 against the installed torch's headers, on any machine with nvcc
(CPU-only CI included): API drift in torch's C++ headers or a syntax slip shows here, before a GPU run.
ptxas's resource report is checked too: the kernels must not spill more than the one known small spill
(fp16/bf16 backward at 32 elements per thread: 60 bytes)."""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sysconfig

import pytest
import torch.utils.cpp_extension as cpp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cu")))


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in [os.environ.get("CUDA_HOME"), cpp.CUDA_HOME] + sorted(glob.glob("/usr/local/cuda*"), reverse=True):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return None


NVCC = _nvcc()
PY_INCLUDE = sysconfig.get_paths()["include"]


@pytest.mark.skipif(NVCC is None, reason="needs nvcc (CUDA toolkit)")
@pytest.mark.skipif(not os.path.exists(os.path.join(PY_INCLUDE, "Python.h")), reason="needs Python headers")
@pytest.mark.parametrize("source", SOURCES, ids=[os.path.basename(s) for s in SOURCES])
def test_cuda_source_compiles_for_sm90(source, tmp_path):
    # CPU wheels of torch ship c10/cuda without the header CMake generates for CUDA builds: a stub
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    includes = [str(tmp_path / "stub")] + cpp.include_paths() + [PY_INCLUDE]
    cmd = [NVCC, "-c", source, "-o", str(tmp_path / "out.o"), "-std=c++17", "-O3", "--use_fast_math",
           "-arch=sm_90", "-Xptxas", "-v", "-diag-suppress", "3306", "-DTORCH_EXTENSION_NAME=_C",
           "-DTORCH_API_INCLUDE_EXTENSION_H", "-D_GLIBCXX_USE_CXX11_ABI=1"] + [f"-I{i}" for i in includes]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    report = res.stdout + res.stderr
    kernels = re.findall(r"Compiling entry function '(\w+)'", report)
    assert kernels, "ptxas reported no kernels"
    spills = [int(b) for b in re.findall(r"(\d+) bytes spill stores", report)]
    assert len(spills) == len(kernels)
    assert max(spills) <= 64, f"a kernel spills {max(spills)} bytes"
