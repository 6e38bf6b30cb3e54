#!/usr/bin/env bash
# A one-call A/B of two builds of the C++ attention (GPU): build A with csrc/attention.cuh replaced by the file
# named first (export it beforehand, e.g. `git show REV:csrc/attention.cuh > _a_attention.cuh`; the device copy has
# no .git), time it, restore the working tree's file, build B, time it. Each build is `benchmarks/gpu_run.sh` with
# no stages (about 150 s on the device). Lines `A1 ...`, `A2 ...`, `B1 ...`, `B2 ...` as attention_cuda_ab.py prints
# them go to $OUT/ab.txt. Usage: bash benchmarks/dev/attention_cuda_ab_builds.sh _a_attention.cuh [REPS]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
A=${1:?"usage: attention_cuda_ab_builds.sh A_ATTENTION_CUH [REPS]"}
REPS=${2:-2}
cp csrc/attention.cuh /tmp/ab_b_attention.cuh
trap 'cp /tmp/ab_b_attention.cuh csrc/attention.cuh' EXIT
T0=$(date +%s)
for side in A B; do
  if [ $side = A ]; then cp "$A" csrc/attention.cuh; else cp /tmp/ab_b_attention.cuh csrc/attention.cuh; fi
  STAGES="" bash benchmarks/gpu_run.sh >"$OUT/build_$side.txt" 2>&1
  echo "build $side: $(( $(date +%s) - T0 )) s; $(tail -1 "$OUT/build_$side.txt")"
  for r in $(seq 1 "$REPS"); do python3 benchmarks/dev/attention_cuda_ab.py "$side$r" 2>&1 | tee -a "$OUT/ab.txt"; done
done
