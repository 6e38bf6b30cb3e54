"""Shared benchmark machinery: timing, the environment record, and the result writer.

Timing: ``triton.testing.do_bench`` (CUDA events, L2 flushed before each repetition, median).
Every result row carries the card, the versions, the date and the commit, and goes to
``benchmarks/results/<op>_<card>_<date>.csv`` and, when ``$OUT`` is set (the device machine),
``$OUT/<op>.csv``.
"""
from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def bandwidth_args(op: str, doc: str, default_budget_s: float):
    """The command line of the bandwidth-bound op benchmarks (layer_norm, cross_entropy): ``--smoke``
    (sets ``TRITON_INTERPRET=1``, which must precede importing triton), ``--no-compile``, ``--budget-s``
    (the compile peer is skipped past 60% of it), ``--no-graph``. Returns the parsed arguments, or None
    after saying why when there is neither a CUDA device nor ``--smoke``."""
    import argparse
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, no timing record")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument("--budget-s", type=float, default=default_budget_s,
                    help="skip the compile peer past 60%% of this")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    elif not torch.cuda.is_available():
        print(f"{op} benchmark: no CUDA device; nothing to time (use --smoke to check the plumbing)")
        return None
    return args


def env_record() -> dict:
    """Card, versions, date and commit, stamped on every row."""
    import triton
    try:  # "-dirty" when tracked files differ from HEAD (a device copy may carry a stale .git: never a clean
        # hash for code that is not that commit)
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - the device copy may have no git
        commit = os.environ.get("PYKERNELS_COMMIT", "unknown")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or "none",
        "cudnn": str(torch.backends.cudnn.version()) if torch.cuda.is_available() else "none",
        "python": sys.version.split()[0],
        "date": _dt.date.today().isoformat(),
        "commit": os.environ.get("PYKERNELS_COMMIT", commit),
    }


def bench(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` on the GPU (L2 flushed between runs)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_fwd_bwd(fwd: Callable[[], torch.Tensor], grad: torch.Tensor | None = None, inputs=(),
                  **kw) -> tuple[float, float]:
    """(forward ms, backward ms): forward alone, and forward+backward minus forward.

    ``inputs``: tensors whose ``.grad`` is reset to None between runs (so accumulation costs
    nothing extra)."""
    f_ms = bench(fwd, **kw)

    def step():
        for t in inputs:
            t.grad = None
        out = fwd()
        out.backward(grad if grad is not None else torch.ones_like(out))

    fb_ms = bench(step, **kw)
    return f_ms, max(fb_ms - f_ms, 0.0)


def peak_extra_mib(fn: Callable[[], object]) -> float:
    """Peak memory allocated during ``fn`` above what was allocated before it, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _device_events(fn: Callable[[], object]) -> list:
    """One profiled call of ``fn``: its device-side records (kernels, memcpys, memsets), torch.profiler's events."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _device_us(fn: Callable[[], object]) -> dict[str, float]:
    """One profiled call of ``fn``: each kernel's (and memcpy's / memset's) summed device time in us, by name."""
    out: dict[str, float] = {}
    for e in _device_events(fn):
        out[e.name] = out.get(e.name, 0.0) + e.device_time_total
    return out


def gpu_kernel_ms(fn: Callable[[], object], *, reps: int = 3) -> float:
    """GPU time of ``fn``: the sum of the device time of every kernel and memcpy/memset it issues, per
    call (median of ``reps`` profiled calls, torch.profiler / CUPTI). Unlike CUDA-graph replay it
    works for calls that synchronise (torch.compile's gather-first, pykernels' sized MLM backward);
    like it, it leaves out host time and idle gaps. Warm ``fn`` up before calling this."""
    times = sorted(sum(_device_us(fn).values()) / 1e3 for _ in range(reps))
    return times[len(times) // 2]


def gpu_busy_ms(fn: Callable[[], object], *, reps: int = 3) -> float:
    """GPU time of ``fn`` as the union of its kernels' (and memcpy's / memset's) device intervals, per call (median
    of ``reps`` profiled calls): what gpu_kernel_ms gives where the kernels run one after another, and the time
    the device was busy where they overlap (kernels on several streams, or one launched as another's programmatic
    dependent, as HISTORY.md's run356 tried). Idle gaps are left out, as there. Warm ``fn`` up before calling
    this."""
    times = []
    for _ in range(reps):
        spans = sorted((e.time_range.start, e.time_range.end) for e in _device_events(fn))
        busy, end = 0.0, float("-inf")
        for a, b in spans:
            if b > end:
                busy += b - max(a, end)
                end = b
        times.append(busy / 1e3)
    times.sort()
    return times[len(times) // 2]


def gpu_kernels_us(fn: Callable[[], object], calls: int = 1) -> list[tuple[float, str]]:
    """Each kernel's device time a call of ``fn`` (one profiled run of ``fn``, which makes ``calls`` calls),
    longest first. Warm ``fn`` up before calling this."""
    return sorted(((us / calls, name) for name, us in _device_us(fn).items()), reverse=True)


def ceilings() -> dict:
    """Copy bandwidth (read+write, TB/s) and bf16 matmul rate (TFLOP/s) measured on this card now."""
    n = 1 << 28  # 512 MiB of bf16 each way
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    copy_tbs = 2 * a.numel() * a.element_size() / ms / 1e9
    a = b = None  # (freed before the matmul)
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    ms = bench(lambda: x @ y)
    return {"copy_TBps": round(copy_tbs, 3), "matmul_bf16_TFLOPs": round(2 * m**3 / ms / 1e9, 1)}


def graph_us(fn: Callable[[], object], *, rep: int = 10) -> float:
    """``fn``'s time a call in us, replayed from a CUDA graph of unrolled calls (``do_bench_cudagraph``, ``rep`` ms)."""
    import triton.testing
    return float(triton.testing.do_bench_cudagraph(fn, rep=rep)) * 1e3


def env_settings(spec: str) -> list[dict[str, str]]:
    """The dev A/B scripts' ``--settings``: ``"A=1,B=0;A=0"`` -> ``[{"A": "1", "B": "0"}, {"A": "0"}]``, names
    without their ``PYKERNELS_`` prefix (an empty setting is ``{}``: the environment as it is)."""
    out = []
    for one in spec.split(";"):
        setting = {}
        for kv in (kv.strip() for kv in one.split(",")):
            if kv:
                name, sep, value = kv.partition("=")
                if not sep or not name:
                    raise ValueError(f"a setting is NAME=VALUE[,NAME=VALUE], got {kv!r} in {spec!r}")
                setting[name] = value
        out.append(setting)
    return out


def settings_label(setting: dict[str, str]) -> str:
    """``{"A": "1", "B": "0"}`` -> ``"A=1,B=0"`` (``"default"`` for ``{}``)."""
    return ",".join(f"{k}={v}" for k, v in setting.items()) or "default"


@contextlib.contextmanager
def env_setting(setting: dict[str, str | None]) -> Iterator[None]:
    """``PYKERNELS_<name>`` set to each value of ``setting`` (None: unset) inside the block, each restored (or unset)
    after it: a setting need not name the variables of the one before it."""
    def put(values: dict[str, str | None]) -> None:
        for k, v in values.items():
            if v is None:
                os.environ.pop("PYKERNELS_" + k, None)
            else:
                os.environ["PYKERNELS_" + k] = v

    old = {k: os.environ.get("PYKERNELS_" + k) for k in setting}
    put(setting)
    try:
        yield
    finally:
        put(old)


def copy_graph_us(nbytes: int, *, rep: int = 10) -> float:
    """A ``copy_`` of ``nbytes`` (half read, half written) replayed from a CUDA graph (``graph_us``), us: what a
    kernel moving those bytes reaches at that size, launch ramp and tail included (``ceilings()`` copies 1 GiB)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return graph_us(lambda: dst.copy_(src), rep=rep)


def write_rows(op: str, rows: list[dict]) -> Path:
    """Write rows (dicts) plus the environment record as CSV to benchmarks/results and $OUT."""
    env = env_record()
    rows = [{**r, **env} for r in rows]
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    card = env["gpu"].replace(" ", "_").replace("/", "_")
    targets = [RESULTS / f"{op}_{card}_{env['date']}.csv"]
    if os.environ.get("OUT"):
        targets.append(Path(os.environ["OUT"]) / f"{op}.csv")
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
    return targets[-1]


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = [max(len(c), *(len(f"{r.get(c, '')}") for r in rows)) for c in cols]
    print(" | ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(f"{r.get(c, '')}".ljust(w) for c, w in zip(cols, widths)))
