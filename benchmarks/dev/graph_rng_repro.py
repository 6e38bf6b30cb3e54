"""Does a CUDA graph's first replay draw from the generator state it is given? (GPU; the order-dependent failure of
tests/test_cudagraphs.py::test_dropout_under_cuda_graph_capture: README, Known issues.)

Each trial does what that test does, with nothing of pykernels unless ``--op`` names one: a step that draws a seed
with ``torch.randint`` on the device (as ``pykernels._rng.new_seed``), uses it in a few kernels and runs a backward
through autograd; the step run once on a side stream (warm-up), then captured in a fresh ``torch.cuda.CUDAGraph``;
then ``torch.cuda.manual_seed(7)``, a replay, and the seed the graph drew against the eager draw after
``torch.cuda.manual_seed(7)``. A trial fails where they differ; the line says whether the graph's seed was the
warm-up's. ``--procs N`` runs N such processes at once on the one GPU (the failure was seen under 8-14 pytest
workers), each for ``--seconds``.

``--discard N`` replays the graph N times before the three checked replays; ``--sync`` synchronizes the device
between the capture and the replays.

Usage: ``python benchmarks/dev/graph_rng_repro.py [--op none|layer_norm|attention] [--procs 14] [--seconds 30]
[--discard 0] [--sync]``
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch


def new_seed():
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device="cuda")


def make_step(op: str):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 768, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    dout = torch.randn(256, 768, device="cuda", dtype=torch.bfloat16, generator=g)
    drawn = []

    def step():
        if op == "none":  # a seed and some kernels that read it, then autograd's backward
            s = new_seed()
            drawn.append(s)
            y = x * ((s % 7) + 1).to(x.dtype)
            out = torch.nn.functional.layer_norm(y, (768,))
        else:
            import pykernels
            from pykernels import _rng
            real = _rng.new_seed

            def spy(device=None):
                t = real(device)
                drawn.append(t)
                return t
            _rng.new_seed = spy
            try:
                if op == "layer_norm":
                    out = pykernels.layer_norm(x, torch.ones(768, device="cuda", dtype=x.dtype), dropout_p=0.3,
                                               backend="triton")
                else:
                    q = x.view(2, 12, 128, 64)
                    out = pykernels.scaled_dot_product_attention(q, q, q, dropout_p=0.3, backend="triton")
                    out = out.reshape(256, 768)
            finally:
                _rng.new_seed = real
        return [out.detach()] + list(torch.autograd.grad(out, [x], dout))
    return step, drawn


def trial(op: str, discard: int = 0, sync: bool = False) -> tuple[list[bool], str | None]:
    step, drawn = make_step(op)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    warm = drawn[-1].item()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seed_t = drawn[-1]
    if sync:  # the device idle before the first replay
        torch.cuda.synchronize()
    for _ in range(discard):  # replays before the checked ones
        graph.replay()
    got = []
    for s in (7, 8, 7):
        torch.cuda.manual_seed(s)
        graph.replay()
        torch.cuda.synchronize()
        got.append(seed_t.item())
    want = []
    for s in (7, 8, 7):
        torch.cuda.manual_seed(s)
        want.append(new_seed().item())
    wrong = [a != b for a, b in zip(got, want)]
    if not any(wrong):
        return wrong, None
    return wrong, f"replays drew {got}, eager {want}, warm-up {warm}" + (
        " (the first replay drew the warm-up's seed)" if got[0] == warm else "")


def worker(op: str, seconds: float, discard: int, sync: bool) -> int:
    torch.manual_seed(0)
    n = bad = 0
    per = [0, 0, 0]  # failures by replay (first, second, third checked)
    t0 = time.time()
    while time.time() - t0 < seconds:
        torch.manual_seed(0)
        wrong, r = trial(op, discard, sync)
        n += 1
        per = [a + b for a, b in zip(per, wrong)]
        if r is not None:
            bad += 1
            if bad <= 2:
                print(f"pid {os.getpid()} trial {n}: {r}", flush=True)
    print(f"pid {os.getpid()}: {bad} of {n} trials failed; by replay {per}", flush=True)
    return bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", choices=("none", "layer_norm", "attention"), default="none")
    ap.add_argument("--procs", type=int, default=14)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--discard", type=int, default=0, help="replays before the checked ones")
    ap.add_argument("--sync", action="store_true", help="torch.cuda.synchronize() between capture and replays")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        sys.exit(1 if worker(a.op, a.seconds, a.discard, a.sync) else 0)
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, op {a.op}, {a.procs} processes, "
          f"{a.seconds} s each, {a.discard} replays discarded, sync {a.sync}", flush=True)
    ps = [subprocess.Popen([sys.executable, __file__, "--worker", "--op", a.op, "--seconds", str(a.seconds),
                            "--discard", str(a.discard)] + (["--sync"] if a.sync else [])) for _ in range(a.procs)]
    failed = sum(p.wait() != 0 for p in ps)
    print(f"# {failed} of {a.procs} processes saw a failing trial", flush=True)


if __name__ == "__main__":
    main()
