"""What ptxas and the SASS say about the C++ kernels, on a machine without a GPU (nvcc and the ``cuobjdump`` that
triton's wheel bundles are enough): the per-kernel resources of a build, the difference between two builds, and the
instruction mix of a kernel with the size of every out-of-line function it calls. The C++ attention's dropout was
found this way (2026-11-28, HISTORY.md's thirty-second session): its lane exchange was an out-of-line call of 159
instructions with divergent branches, and each Philox multiply added a zero register to its high word.

The sources compile as ``tests/test_csrc.py`` compiles them (sm_90a, its flags, torch's headers with its stub).

Usage::

    python benchmarks/dev/cuda_sass.py resources csrc/attention_bwd_bf16.cu [--match REGEX] [--save a.json]
    python benchmarks/dev/cuda_sass.py diff a.json b.json
    python benchmarks/dev/cuda_sass.py sass csrc/attention_fwd_bf16.cu --match 'ws_kernel.*Li64ELi0E' [--top 20]

``resources`` prints registers, spill-store bytes and stack frame a kernel (``--save``: as JSON for ``diff``);
``diff`` the kernels whose resources differ between two saved builds; ``sass`` each matching kernel's instruction
count and most frequent opcodes, then each ``CALL`` target in it: its size up to ``RET`` and its opcodes.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import test_csrc  # noqa: E402  (NVCC, the flags, include flags and defines of the compile test)

_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def compile_source(source: str, workdir: str, *, verbose: bool) -> tuple[str, str]:
    """nvcc -c ``source`` for sm_90a into ``workdir``: (the object's path, ptxas's report when ``verbose``)."""
    if test_csrc.NVCC is None:
        raise SystemExit("needs nvcc (CUDA toolkit)")
    os.makedirs(os.path.join(workdir, "inc"), exist_ok=True)
    obj = os.path.join(workdir, "out.o")
    cmd = [test_csrc.NVCC, "-c", source, "-o", obj] + test_csrc.SM90A_FLAGS + (["-Xptxas", "-v"] if verbose else [])
    cmd += test_csrc.DEFINES + test_csrc._includes(Path(workdir) / "inc")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        errors = [ln for ln in (r.stdout + r.stderr).splitlines() if " error" in ln]
        tail = (r.stdout + r.stderr)[-2000:]
        raise SystemExit(f"nvcc failed ({r.returncode}):\n" + "\n".join(errors[:20]) + f"\n{tail}")
    return obj, r.stdout + r.stderr


def parse_resources(report: str) -> dict[str, dict[str, int]]:
    """ptxas -v's report -> {kernel: {"regs", "spill", "stack"}} for every entry function."""
    out: dict[str, dict[str, int]] = {}
    entry = props = None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            entry = m.group(1)
            continue
        m = re.search(r"Function properties for (\w+)", line)
        if m:
            props = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", line)
        if m and entry is not None and props == entry:
            out.setdefault(entry, {}).update(stack=int(m.group(1)), spill=int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m and entry is not None:
            out.setdefault(entry, {})["regs"] = int(m.group(1))
    return out


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    import triton
    bundled = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    if not bundled:
        raise SystemExit("needs cuobjdump (the CUDA toolkit's, or the one triton's wheel bundles)")
    return bundled[0]


def sass_functions(obj: str) -> dict[str, list[tuple[int, str]]]:
    """{kernel: [(address, instruction), ...]} from ``cuobjdump -sass``; out-of-line functions sit inside the
    kernels that call them."""
    text = subprocess.run([cuobjdump(), "-sass", obj], capture_output=True, text=True, check=True).stdout
    funcs: dict[str, list[tuple[int, str]]] = {}
    for part in text.split("Function : ")[1:]:
        name = part.split(None, 1)[0]
        code = [(int(m.group(1), 16), m.group(2)) for m in map(_INS.search, part.splitlines()) if m]
        funcs[name] = [(a, i) for a, i in code if opcode(i) != "NOP"]  # (the alignment padding after the end)
    return funcs


def stable_name(name: str) -> str:
    """``name`` with its anonymous namespace (``<len>_GLOBAL__N__<hash>_<file>_<hash>_<n>``, which differs between two
    compiles of one source in different directories) as ``_ANON_``, so that ``diff`` pairs the same kernel."""
    out, pos = [], 0
    for m in re.finditer(r"(\d+)_GLOBAL__N_", name):
        if m.start() < pos:
            continue
        start = m.start(1) + len(m.group(1))
        out.append(name[pos:m.start()] + "_ANON_")
        pos = start + int(m.group(1))
    return "".join(out) + name[pos:]


def opcode(ins: str) -> str:
    words = ins.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def call_targets(code: list[tuple[int, str]]) -> dict[int, list[str]]:
    """Each ``CALL`` target's instructions, from its address up to its ``RET``."""
    at = {a: i for a, i in code}
    out: dict[int, list[str]] = {}
    for _, ins in code:
        m = re.search(r"CALL\.\S+\s+(0x[0-9a-f]+)", ins)
        if not m or int(m.group(1), 16) in out:
            continue
        a, body = int(m.group(1), 16), []
        while a in at:
            body.append(at[a])
            if opcode(at[a]) == "RET":
                break
            a += 16
        out[int(m.group(1), 16)] = body
    return out


def _mix(instructions, top: int) -> str:
    counts = collections.Counter(opcode(i) for i in instructions)
    return " ".join(f"{k}:{v}" for k, v in counts.most_common(top))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("resources")
    r.add_argument("source")
    r.add_argument("--match", default="")
    r.add_argument("--save")
    d = sub.add_parser("diff")
    d.add_argument("a")
    d.add_argument("b")
    s = sub.add_parser("sass")
    s.add_argument("source")
    s.add_argument("--match", default="")
    s.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    if args.cmd == "diff":
        with open(args.a) as fa, open(args.b) as fb:
            a, b = ({stable_name(k): v for k, v in json.load(f).items()} for f in (fa, fb))
        changed = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        for k in changed:
            print(f"{a.get(k)} -> {b.get(k)}  {k}")
        print(f"{len(changed)} of {len(set(a) | set(b))} kernels differ")
        return
    with tempfile.TemporaryDirectory() as work:
        obj, report = compile_source(args.source, work, verbose=args.cmd == "resources")
        if args.cmd == "resources":
            res = {k: v for k, v in parse_resources(report).items() if re.search(args.match, k)}
            for k, v in res.items():
                print(f"{v.get('regs', 0):4d} regs {v.get('spill', 0):5d} B spill {v.get('stack', 0):5d} B stack  {k}")
            if args.save:
                with open(args.save, "w") as f:
                    json.dump(res, f, indent=1, sort_keys=True)
            return
        for name, code in sass_functions(obj).items():
            if not re.search(args.match, name):
                continue
            print(f"{name}: {len(code)} instructions; {_mix((i for _, i in code), args.top)}")
            for addr, body in call_targets(code).items():
                print(f"  CALL {addr:#x}: {len(body)} instructions; {_mix(body, args.top)}")


if __name__ == "__main__":
    main()
