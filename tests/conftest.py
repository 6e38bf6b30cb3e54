"""Test setup: Triton runs under its CPU interpreter when no GPU is present; every kernel output is
poisoned with NaN before the kernel writes it (PYKERNELS_POISON=1)."""
import os
import sys

# The repository's kernels/ (installed as pykernels._kernels) is also a top-level package ``kernels`` to a process
# whose sys.path holds the repository root (``python -m pytest`` puts the working directory there), where it would
# shadow Hugging Face's ``kernels``, which transformers >= 5.25 imports (and requires): keep the root off sys.path
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PYKERNELS_POISON", "1")
# On the GPU each test's new compile-time flags would compile and time every autotune config of every
# kernel; tests use each kernel's default config (benchmarks autotune, and validate before timing).
os.environ.setdefault("PYKERNELS_AUTOTUNE", "0")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    """The device the Triton kernels run on here: CUDA when present, else CPU under the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
    if HAS_CUDA:
        # pytest-xdist runs several workers on one GPU: hand cached blocks back after each test so
        # that the large-offset tests (tens of GB) find the memory free
        torch.cuda.empty_cache()


_ORDER_DIR = os.environ.get("PYKERNELS_TEST_ORDER_DIR")


def pytest_runtest_logreport(report):
    """With PYKERNELS_TEST_ORDER_DIR set, each process (each xdist worker) appends the tests it ran, in its order,
    with their outcome, to ``order_<worker>.txt`` there: what ran before a failure that depends on the tests run
    before it in that process."""
    if _ORDER_DIR and (report.when == "call" or report.outcome != "passed"):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(_ORDER_DIR, f"order_{worker}.txt"), "a") as f:
            f.write(f"{report.outcome} {report.when} {report.nodeid}\n")
