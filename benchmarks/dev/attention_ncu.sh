#!/usr/bin/env bash
# Nsight Compute on one launch of each named sm_90 attention kernel (benchmarks/dev/attention_ncu.py runs the
# case): per kernel, $OUT/ncu_<case>_<kernel>.txt (sections) and .csv (SASS lines with stall samples).
# A case may name a peer after "@" (attention_ncu.py --peer): "bert@cudnn:sdpa_sm90_flash_fprop" profiles cuDNN's
# forward kernel on the same case. LaunchStats and Occupancy give each kernel's grid, block, registers and
# shared memory.
# NCU_BACKEND names pykernels' backend: NCU_BACKEND=cuda NCU_JOBS="bert:attn_fwd_kernel bertpad:attn_fwd_kernel"
# profiles the C++ forward unmasked and with the benchmark's key padding (the gap the twenty-third session left).
# NCU_DROPOUT sets the calls' dropout_p: NCU_BACKEND=cuda NCU_DROPOUT=0.1 NCU_JOBS="bert:attn_bwd_sm90_kernel"
# profiles the fused backward with dropout.
# Usage (GPU): NCU_JOBS="bert:fwd_sm90 s4096c:dkdv s4096c:bwd_dq" bash benchmarks/dev/attention_ncu.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
for job in ${NCU_JOBS:-"bert:fwd_sm90 s4096c:dkdv s4096c:bwd_dq"}; do
  case=${job%%:*}; kern=${job#*:}
  peer=pykernels
  if [[ $case == *@* ]]; then peer=${case#*@}; case=${case%%@*}; fi
  tag=${case}_${kern}
  [[ $peer == pykernels ]] || tag=${case}_${peer}_${kern}
  rep=/tmp/ncu_${tag}
  timeout 240 ncu --clock-control none -k "regex:$kern" -s 1 -c 1 --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section SourceCounters --section MemoryWorkloadAnalysis --section LaunchStats \
    --section Occupancy -f -o "$rep" \
    python3 benchmarks/dev/attention_ncu.py --case "$case" --peer "$peer" ${NCU_BACKEND:+--backend "$NCU_BACKEND"} \
    ${NCU_DROPOUT:+--dropout "$NCU_DROPOUT"} \
    --reps 2 >"$OUT/ncu_${tag}.log" 2>&1
  echo "$job rc=$?"
  ncu -i "$rep.ncu-rep" --page details >"$OUT/ncu_${tag}.txt" 2>&1
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu_${tag}.csv" 2>&1
  head -c 3000 "$OUT/ncu_${tag}.txt"
done
