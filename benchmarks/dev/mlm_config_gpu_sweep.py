"""The masked-LM loss's TMA logits-kernel tiles timed in GPU time (the sum of the kernels' device time of a
public forward+backward, torch.profiler), not with do_bench: at BERT-base the sized backward is host-bound,
so do_bench ranks the backward's tiles by host noise (``mlm_tma_probe.py``'s note). Per case and per
config of the forward (``TMA_FWD_CONFIG``) and of the backward's dz kernel (``TMA_DZ_CONFIG``), one at a
time with the other at its default: the total GPU time and the logits kernel's share. Tiles change the
summation order, so each result is checked against the first config's loss within 1e-5 relative (and
finite gradients) rather than bit for bit.

Usage (GPU): ``python benchmarks/dev/mlm_config_gpu_sweep.py [--cases bert,gpt2]``"""
from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import pykernels
from pykernels._kernels import masked_lm_loss as kmod

CASES = {"bert": (16384, 2446, 768, 30522, False), "gpt2": (8192, 8192, 768, 50257, True)}
CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3),
           (256, 128, 64, 8, 3), (128, 128, 64, 4, 4), (256, 128, 64, 8, 4)]


def gpu_us(step, reps=5):
    tot, logits = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        tot.append(sum(e.device_time_total for e in ev))
        logits.append(sum(e.device_time_total for e in ev if "logits_tma" in e.name))
    return statistics.median(tot), statistics.median(logits)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="bert,gpt2")
    ap.add_argument("--which", default="TMA_FWD_CONFIG,TMA_DZ_CONFIG")
    ap.add_argument("--configs", default="", help="';'-separated tuples, e.g. '128,256,64,8,3;128,256,32,8,5'")
    args = ap.parse_args()
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";")] if args.configs else CONFIGS
    print(torch.cuda.get_device_name(), torch.__version__)
    defaults = {"TMA_FWD_CONFIG": kmod.TMA_FWD_CONFIG, "TMA_DZ_CONFIG": kmod.TMA_DZ_CONFIG}
    print("defaults", defaults)
    for name in args.cases.split(","):
        n, m, h, v, dense = CASES[name]
        torch.manual_seed(0)
        hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        weight = (torch.randn(v, h, device="cuda") * h**-0.5).to(torch.bfloat16).requires_grad_()
        target = torch.full((n,), -100, device="cuda")
        target[torch.randperm(n, device="cuda")[:m]] = torch.randint(0, v, (m,), device="cuda")
        ref = None
        for attr in args.which.split(","):
            for cfg in configs:
                setattr(kmod, attr, cfg)
                try:
                    def step():
                        hidden.grad = weight.grad = None
                        loss = pykernels.masked_lm_loss(hidden, weight, target, dense=dense)
                        loss.backward()
                        return loss

                    loss = step()
                    step()
                    if ref is None:
                        ref = loss.item()
                    ok = abs(loss.item() - ref) <= 1e-5 * abs(ref) and bool(torch.isfinite(hidden.grad).all())
                    tot, lg = gpu_us(step)
                    mark = " (default)" if cfg == defaults[attr] else ""
                    print(f"{name:5s} {attr:15s} {str(cfg):22s} GPU {tot:8.1f} us, logits kernel {lg:8.1f} us "
                          f"{'ok' if ok else 'MISMATCH'}{mark}", flush=True)
                except Exception as e:  # noqa: BLE001 - out of resources: record and go on
                    print(f"{name:5s} {attr:15s} {str(cfg):22s} {type(e).__name__}: {str(e)[:80]}", flush=True)
            setattr(kmod, attr, defaults[attr])


if __name__ == "__main__":
    main()
