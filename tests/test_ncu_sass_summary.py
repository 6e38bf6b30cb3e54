"""``benchmarks/dev/ncu_sass_summary.py``: the comparison of two kernels' Nsight Compute SASS tables (run126) rests
on it setting the parked idle warps apart and counting the rest by reason, opcode and execution count, so a
small table with known answers checks it (CPU only: it parses the CSV ncu writes)."""
from __future__ import annotations

import csv
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def summary():
    spec = importlib.util.spec_from_file_location("ncu_sass_summary",
                                                  os.path.join(ROOT, "benchmarks", "dev", "ncu_sass_summary.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(path, rows):
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_barrier",
              "stall_wait", "stall_selected", "stall_long_sb", "stall_wait (Not Issued)"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "toy_kernel"])
        w.writerow(header)
        for i, (src, samples, executed, barrier, wait, selected, long_sb) in enumerate(rows):
            # thousands separators, as ncu writes them
            w.writerow([hex(i * 16), src, f"{samples:,}", f"{executed:,}", barrier, wait, selected, long_sb, 99])


def test_parked_warps_are_set_apart_and_the_rest_counted(summary, tmp_path):
    path = tmp_path / "toy.csv"
    _write(path, [
        ("MUFU.EX2 R1, R2", 30, 18432, 0, 20, 10, 0),
        ("@!P1  BRA 0x7f00", 20, 4608, 0, 0, 0, 20),
        ("FFMA R3, R4, R5, R6", 10, 18432, 0, 5, 5, 0),
        ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 40, 6144, 40, 0, 0, 0),
        ("NOP", 100, 264, 100, 0, 0, 0),  # idle warps parked at the last barrier: left out
        ("NOP", 2, 264, 0, 2, 0, 0),  # executed as rarely, but not a barrier stall: counted
    ])
    out = summary.summarise(str(path), ["wait", "barrier"])
    lines = out.splitlines()
    assert lines[0] == "== toy_kernel"
    # 18432 + 4608 + 18432 + 6144 + 264 + 264 = 48144 warp instructions; 202 samples, 100 of them parked
    assert "48144 warp instructions executed, 6 SASS lines; 202 stall samples, of them 100 (49.5%) parked" in lines[1]
    # the mix counts executions per opcode (predicates and modifiers stripped)
    assert "MUFU 38.3%" in lines[2] and "FFMA 38.3%" in lines[2] and "BRA 9.6%" in lines[2]
    # reasons over the 102 samples left: barrier 40, wait 27, long_sb 20, selected 15 (the "(Not Issued)"
    # column is not a reason of its own)
    assert lines[3] == "   stalls: barrier 39.2%, wait 26.5%, long_sb 19.6%, selected 14.7%"
    wait = next(ln for ln in lines if ln.startswith("   wait:"))
    assert "MUFU 74%" in wait and "FFMA 19%" in wait and "NOP 7%" in wait
    assert "N=18432: 93%" in wait
    barrier = next(ln for ln in lines if ln.startswith("   barrier:"))
    assert "WARPGROUP 100%" in barrier and "N=6144: 100%" in barrier
