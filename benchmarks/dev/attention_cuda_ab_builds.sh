#!/usr/bin/env bash
# A one-call A/B of two builds of the C++ attention (GPU): build A with csrc/attention.cuh replaced by the file named
# first, or with every file of the folder named first copied over csrc/ (export them beforehand, e.g.
# `git show REV:csrc/attention.cuh > _a/attention.cuh`; the device copy has no .git), time it, restore the working
# tree's files, build B, time it. Each build is `benchmarks/gpu_run.sh` with no stages (about 150 s on the device).
# After each build: attention_cuda_ab.py's lines (`A1 ...`, `B1 ...`) to $OUT/ab.txt, and with AB_DROPOUT=1
# benchmarks/dev/attention_dropout_kernels.py's instead (`A1 ...`; AB_PEERS=1 adds its peers after build B; AB_CASES
# its cases, e.g. bert_pad,bert_varlen,d128_pad,d128_varlen; AB_ARGS more of its arguments, e.g. --kernels); AB_EXTRA,
# a command run once after each build's lines, its output prefixed with the side (e.g. ln_dropout_kernels.py).
# Usage: bash benchmarks/dev/attention_cuda_ab_builds.sh _a_attention.cuh|_a/ [REPS]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
A=${1:?"usage: attention_cuda_ab_builds.sh A_ATTENTION_CUH|A_DIR [REPS]"}
REPS=${2:-2}
if [ -d "$A" ]; then FILES=$(cd "$A" && ls); else FILES=attention.cuh; fi
SAVE=$(mktemp -d)
for f in $FILES; do cp "csrc/$f" "$SAVE/$f"; done
trap 'for f in $FILES; do cp "$SAVE/$f" "csrc/$f"; done' EXIT
T0=$(date +%s)
for side in A B; do
  for f in $FILES; do
    if [ $side = B ]; then cp "$SAVE/$f" "csrc/$f"; elif [ -d "$A" ]; then cp "$A/$f" "csrc/$f"; else cp "$A" "csrc/$f"; fi
  done
  STAGES="" bash benchmarks/gpu_run.sh >"$OUT/build_$side.txt" 2>&1
  echo "build $side: $(( $(date +%s) - T0 )) s; $(tail -1 "$OUT/build_$side.txt")"
  for r in $(seq 1 "$REPS"); do
    if [ "${AB_DROPOUT:-0}" = 1 ]; then
      peers=""; [ $side = B ] && [ $r = "$REPS" ] && [ "${AB_PEERS:-0}" = 1 ] && peers=--peers
      python3 benchmarks/dev/attention_dropout_kernels.py "$side$r" $peers ${AB_CASES:+--cases "$AB_CASES"} \
        ${AB_ARGS:-} 2>&1 | tee -a "$OUT/ab.txt"
    else
      python3 benchmarks/dev/attention_cuda_ab.py "$side$r" 2>&1 | tee -a "$OUT/ab.txt"
    fi
  done
  [ -n "${AB_EXTRA:-}" ] && bash -c "$AB_EXTRA" 2>&1 | sed "s/^/$side /" | tee -a "$OUT/ab.txt"
done
