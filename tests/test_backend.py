"""The backend machinery every op shares: default, context manager, availability, selection."""
import warnings

import pytest
import torch

import pykernels
from pykernels import _backend
from pykernels._backend import BackendUnavailableError, FallbackWarning, select


def test_backends_reports_every_backend_with_a_reason_when_missing():
    info = pykernels.backends()
    assert set(info) == {"triton", "cuda", "reference"}
    assert info["reference"].available and info["reference"].reason is None
    for name, b in info.items():
        assert b.available == (b.reason is None), name
        if not b.available:
            assert isinstance(b.reason, str) and len(b.reason) > 10


def test_cuda_extension_missing_is_explained():
    info = pykernels.backends()["cuda"]
    if not info.available:
        assert "pykernels._C" in info.reason or "CUDA" in info.reason


def test_use_backend_nests_and_restores(monkeypatch):
    monkeypatch.delenv("PYKERNELS_BACKEND", raising=False)
    assert pykernels.default_backend() == "auto"
    with pykernels.use_backend("reference"):
        assert pykernels.default_backend() == "reference"
        with pykernels.use_backend("triton"):
            assert pykernels.default_backend() == "triton"
        assert pykernels.default_backend() == "reference"
    assert pykernels.default_backend() == "auto"


def test_use_backend_restores_after_exception(monkeypatch):
    monkeypatch.delenv("PYKERNELS_BACKEND", raising=False)
    with pytest.raises(KeyError):
        with pykernels.use_backend("reference"):
            raise KeyError("x")
    assert pykernels.default_backend() == "auto"


def test_env_var_sets_default(monkeypatch):
    monkeypatch.setenv("PYKERNELS_BACKEND", "reference")
    assert pykernels.default_backend() == "reference"
    monkeypatch.setenv("PYKERNELS_BACKEND", "bogus")
    with pytest.raises(ValueError, match="PYKERNELS_BACKEND"):
        pykernels.default_backend()


def test_compiled_routing_reads_use_backend_when_traced(monkeypatch):
    # torch.compile cannot read use_backend's ContextVar: the routing it traces (which ops take their C++ compiled
    # pair) reads a process-wide mirror that dynamo guards on, so one compiled function called inside another block
    # is traced again for it, and the mirror unwinds with the blocks (exceptions included)
    monkeypatch.delenv("PYKERNELS_BACKEND", raising=False)
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + len(_backend._traced_backend(None)), backend="eager", fullgraph=True)
    x = torch.zeros(1)
    assert f(x).item() == len("auto")
    with pykernels.use_backend("reference"):
        assert f(x).item() == len("reference")
        with pytest.raises(KeyError):
            with pykernels.use_backend("triton"):
                assert f(x).item() == len("triton")
                raise KeyError("x")
        assert f(x).item() == len("reference")
    assert f(x).item() == len("auto")
    assert _backend._traced_default is None
    assert _backend._traced_backend("cuda") == "cuda"
    monkeypatch.setenv("PYKERNELS_BACKEND", "reference")
    assert _backend._traced_backend(None) == "reference"


def test_compiled_call_naming_cuda_it_cannot_serve_raises(device):
    # named under torch.compile, the C++ pair of layer_norm / attention raises with the reason it cannot serve the
    # call, as eagerly: here calls it never covers (N = 1004 is no multiple of the 8-element pack; fp32 attention),
    # and on CPU tensors or without the extension nothing
    torch._dynamo.reset()
    x = torch.randn(4, 1004, device=device, dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailableError, match="backend 'cuda' cannot serve"):
        torch.compile(lambda t: pykernels.layer_norm(t, None, backend="cuda"), backend="eager")(x)
    q = torch.randn(1, 2, 8, 64, device=device)
    with pytest.raises(BackendUnavailableError, match="backend 'cuda' cannot serve"):
        torch.compile(lambda t: pykernels.scaled_dot_product_attention(t, t, t, dropout_p=0.1, backend="cuda"),
                      backend="eager")(q)


@pytest.mark.parametrize("bad", ["Triton", "gpu", 3])
def test_bad_backend_name(bad):
    with pytest.raises(ValueError, match="name"):
        with pykernels.use_backend(bad):
            pass
    with pytest.raises(ValueError, match="backend"):
        select("op", bad, torch.device("cpu"), {"triton": None})


def test_reference_is_always_served():
    assert select("op", "reference", torch.device("cpu"), {"triton": "never"}) == "reference"


def test_auto_on_cpu_is_reference_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select("op", "auto", torch.device("cpu"), {"triton": None}) == "reference"


def test_explicit_backend_on_wrong_device_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match="triton"):
        select("op", "triton", torch.device("cpu"), {"triton": None})


def test_explicit_backend_interpreter_serves_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select("op", "triton", torch.device("cpu"), {"triton": None}) == "triton"


def test_explicit_backend_that_declines_the_case_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(BackendUnavailableError, match="head dim 512"):
        select("op", "triton", torch.device("cpu"), {"triton": "head dim 512 is above 256"})


def test_explicit_backend_the_op_lacks_raises():
    with pytest.raises(BackendUnavailableError, match="no 'cuda' implementation"):
        select("op", "cuda", torch.device("cpu"), {"triton": None})


def test_auto_on_cuda_warns_once_when_the_kernel_declines(monkeypatch):
    # A CUDA device object is enough to exercise the choice; nothing is launched.
    monkeypatch.setattr(_backend, "_warned", set())
    dev = torch.device("cuda")
    with pytest.warns(FallbackWarning, match="mask dtype int8"):
        assert select("op_x", "auto", dev, {"triton": "mask dtype int8"}) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select("op_x", "auto", dev, {"triton": "mask dtype int8"}) == "reference"
    assert select("op_x", "auto", dev, {"triton": None}) == "triton"


def test_auto_prefers_first_available(monkeypatch):
    dev = torch.device("cuda")
    monkeypatch.setattr(_backend, "_availability", lambda name, device: None)
    assert select("op", "auto", dev, {"cuda": None, "triton": None}) == "cuda"
    monkeypatch.setattr(_backend, "_warned", set())
    assert select("op", "auto", dev, {"cuda": "too big", "triton": None}) == "triton"
