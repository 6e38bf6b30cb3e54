"""Where a whole training step's time goes (``benchmarks/train_step.py``'s models and variants): torch.profiler
over a few steps after warm-up, per variant: wall time a step (unprofiled, then profiled), GPU busy time a step
(the kernels' summed device time), and the kernels and host-side ops that take the most. Writes
``$OUT/train_step_profile_<case>.txt``.

Usage (GPU): ``python benchmarks/dev/train_step_profile.py [--models bert gpt2] [--variants "hf sdpa" pykernels]``
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_step as ts  # noqa: E402


def _warm_step(case, variant, state, batch):
    """The variant's model, optimizer and training step (``train_step.py``'s), after 4 warm-up steps."""
    model, fwd = ts.build(case, variant, state, torch.device("cuda"))
    inputs, labels, mask = (*batch, None)[:3]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(inputs, labels, mask)
        loss.backward()
        opt.step()

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    return (model, fwd, opt), step


def profile_variant(case, variant, state, batch, steps: int, out) -> None:
    from torch.profiler import ProfilerActivity, profile
    held, step = _warm_step(case, variant, state, batch)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    bare = (time.perf_counter() - t0) * 1e3 / steps  # the profiler's own host cost inflates the profiled wall
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    events = prof.key_averages()
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time_total for e in gpu) / 1e3 / steps
    print(f"== {case.name} / {variant}: wall {bare:.2f} ms a step unprofiled ({wall:.2f} profiled), GPU kernels "
          f"{busy:.2f} ms a step", file=out)
    print("-- top CUDA kernels (ms a step, calls a step)", file=out)
    for e in sorted(gpu, key=lambda e: -e.device_time_total)[:30]:
        print(f"{e.device_time_total / 1e3 / steps:8.3f} {e.count // steps:5d}  {e.key[:150]}", file=out)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    print("-- top host ops by self CPU time (ms a step, calls a step)", file=out)
    for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:30]:
        print(f"{e.self_cpu_time_total / 1e3 / steps:8.3f} {e.count // steps:5d}  {e.key[:150]}", file=out)
    out.flush()
    del held
    torch.cuda.empty_cache()


def cprofile_variant(case, variant, state, batch, steps: int, out) -> None:
    """Python's cProfile over ``steps`` steps (after warm-up): where the host time goes, by function."""
    import cProfile
    import io
    import pstats
    held, step = _warm_step(case, variant, state, batch)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    print(f"== {case.name} / {variant}: wall {wall:.2f} ms a step without the profiler; cProfile over {steps} steps",
          file=out)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(60)
    out.write(buf.getvalue())
    out.flush()
    del held
    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["bert", "gpt2"])
    ap.add_argument("--variants", nargs="+", default=["hf sdpa", "pykernels"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cprofile", action="store_true", help="Python's cProfile instead of torch.profiler")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    for case in ts.cases(False):
        if case.name not in args.models:
            continue
        state, batch = ts.case_inputs(case, "cuda")
        name = out_dir / f"train_step_{'cprofile' if args.cprofile else 'profile'}_{case.name}.txt"
        with open(name, "w") as out:
            for variant in args.variants:
                (cprofile_variant if args.cprofile else profile_variant)(case, variant, state, batch, args.steps, out)
        print(open(name).read()[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
