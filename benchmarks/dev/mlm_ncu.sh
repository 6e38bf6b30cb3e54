#!/usr/bin/env bash
# Nsight Compute on the masked-LM loss's logit-tile kernels at BERT-base (one public forward+backward warmed up,
# then the second call's kernels): the forward's statistics kernel (Triton, no bias) and the first dz chunk of the
# sm_90 Gluon kernel. Per kernel, $OUT/ncu_mlm_<tag>.txt (sections) and .csv (SASS lines with stall samples;
# ``python benchmarks/dev/ncu_sass_summary.py`` compares them).
# Usage (GPU): bash benchmarks/dev/mlm_ncu.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# tag:kernel-regex:launches to skip (one warm-up step: 1 forward launch, 4 dz chunks at BERT-base)
JOBS=${NCU_JOBS:-"fwd:_logits_tma_kernel:1 dz:_logits_sm90_kernel:4"}
for job in $JOBS; do
  IFS=: read -r tag kern skip <<<"$job"
  rep=/tmp/ncu_mlm_${tag}
  timeout 240 ncu --clock-control none -k "regex:$kern" -s "$skip" -c 1 --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section SourceCounters --section MemoryWorkloadAnalysis \
    --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis --section LaunchStats -f -o "$rep" \
    python3 -c "
import sys; sys.path.insert(0, 'benchmarks/dev')
import torch, pykernels
from mlm_kernel_probe import make
h, w, t = make(16384, 2446, 768, 30522)
for _ in range(2):
    pykernels.masked_lm_loss(h, w, t).backward()
torch.cuda.synchronize()" >"$OUT/ncu_mlm_${tag}.log" 2>&1
  echo "$job rc=$?"
  ncu -i "$rep.ncu-rep" --page details >"$OUT/ncu_mlm_${tag}.txt" 2>&1
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu_mlm_${tag}.csv" 2>&1
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Hit|L2 Hit|Executed Ipc A|Issue Slots Busy|No Eligible|Shared|Registers Per|Dynamic Shared" "$OUT/ncu_mlm_${tag}.txt" | head -30
done
python3 benchmarks/dev/ncu_sass_summary.py "$OUT"/ncu_mlm_fwd.csv "$OUT"/ncu_mlm_dz.csv > "$OUT/ncu_mlm_summary.txt" 2>&1
head -80 "$OUT/ncu_mlm_summary.txt"
