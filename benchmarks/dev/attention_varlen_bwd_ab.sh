#!/usr/bin/env bash
# The A/B of the fused backward over packed varlen sequences by TMA (FUSED = 3 at D = 64, 4 at D = 128), one build, one
# device call: the attention and graph tests, then attention_dropout_kernels.py on the packed and padded BERT batch and
# its D = 128 twin, with the default (TMA), PYKERNELS_CUDA_ATTN_FUSED_DQ=c (the cp.async twin at D = 64, the pair at
# D = 128) and =0 (the pair), two rounds. Results under $OUT (build.log, pytest.txt, ab.txt).
# Usage (device): bash benchmarks/dev/attention_varlen_bwd_ab.sh   (carry .wheels for gpu_run.sh's peers)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
T0=$(date +%s)
STAGES="" bash benchmarks/gpu_run.sh > "$OUT/build.log" 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
echo "build done at $(( $(date +%s) - T0 )) s" >> "$OUT/build.log"
timeout -s INT 170 python3 -m pytest -q -n 8 -rfE -p no:cacheprovider tests/test_attention.py tests/test_cudagraphs.py \
  > "$OUT/pytest.txt" 2>&1; echo "pytest rc=$? at $(( $(date +%s) - T0 )) s" >> "$OUT/pytest.txt"
tail -3 "$OUT/pytest.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20
R=$OUT/ab.txt
echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader) commit ${PYKERNELS_COMMIT:-?} $(date -u)" > "$R"
B=benchmarks/dev/attention_dropout_kernels.py
for r in 1 2; do
  echo "## round $r: default (TMA over packed rows)" >> "$R"
  timeout 90 python3 $B tma --cases bert_pad,bert_varlen,d128_pad,d128_varlen --iters 10 --peers >> "$R" 2>&1
  echo "## round $r: PYKERNELS_CUDA_ATTN_FUSED_DQ=c" >> "$R"
  PYKERNELS_CUDA_ATTN_FUSED_DQ=c timeout 60 python3 $B twin --cases bert_varlen,d128_varlen --iters 10 --peers >> "$R" 2>&1
  echo "## round $r: PYKERNELS_CUDA_ATTN_FUSED_DQ=0" >> "$R"
  PYKERNELS_CUDA_ATTN_FUSED_DQ=0 timeout 60 python3 $B pair --cases bert_varlen,d128_varlen --iters 10 --peers >> "$R" 2>&1
done
echo "bench done at $(( $(date +%s) - T0 )) s" >> "$OUT/build.log"
grep -v "^ \|Warn\|warn" "$R" | grep -v "sdpa-flash\|sdpa-eff"
