"""Does any host call of masked_lm_loss wait for the device? A ~25 ms GPU sleep is queued before each
phase: a phase whose host time includes it blocked somewhere, and cProfile (sorted by own time) names
the call that waited. The backward runs after its forward's count copy has landed (device synchronised
first), so its one intended wait (the count) costs nothing here.

Usage (GPU): ``python benchmarks/dev/mlm_block_probe.py``"""
from __future__ import annotations

import cProfile
import pstats
import time

import torch

import pykernels

SLEEP_CYCLES = int(5e7)  # ~25 ms at ~2 GHz


def main() -> None:
    n, m, h, v = 16384, 2446, 768, 30522
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device="cuda") * h**-0.5).to(torch.bfloat16).requires_grad_()
    target = torch.full((n,), -100, device="cuda")
    target[torch.randperm(n, device="cuda")[:m]] = torch.randint(0, v, (m,), device="cuda")
    for _ in range(3):
        pykernels.masked_lm_loss(hidden, weight, target).backward()
    torch.cuda.synchronize()
    print(torch.cuda.get_device_name(), torch.__version__)
    for phase in ("forward", "backward"):
        for prof in (False, True):
            loss = None
            if phase == "backward":
                loss = pykernels.masked_lm_loss(hidden, weight, target)
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            pr = cProfile.Profile() if prof else None
            t0 = time.perf_counter()
            if pr:
                pr.enable()
            if phase == "forward":
                loss = pykernels.masked_lm_loss(hidden, weight, target)
            else:
                loss.backward()
            if pr:
                pr.disable()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            print(f"{phase}{' (cProfile)' if prof else ''}: host {1e3 * (t1 - t0):.2f} ms, then the device "
                  f"drained in {1e3 * (t2 - t1):.2f} ms (a host time above ~20 ms means a wait)")
            if pr:
                pstats.Stats(pr).sort_stats("tottime").print_stats(8)
    torch.cuda.set_sync_debug_mode("warn")
    loss = pykernels.masked_lm_loss(hidden, weight, target)
    loss.backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    print("sync debug pass done (warnings above name synchronising torch calls)")


if __name__ == "__main__":
    main()
