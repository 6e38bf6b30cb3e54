#!/usr/bin/env bash
# The A/B of the warp-specialised forward's ordered walk over packed varlen sequences and key-padded batches
# (attn_fwd_order_kernel: by key blocks, most first, rounds alternating) against tile_at's round-robin walk
# (PYKERNELS_CUDA_ATTN_FWD_ORDER=0), one build, one device call: the attention and graph tests, then
# attention_dropout_kernels.py on the packed and padded BERT batch and its D = 128 twin, two rounds. Results under
# $OUT (build.log, pytest.txt, ab.txt).
# Usage (device): bash benchmarks/dev/attention_fwd_order_ab.sh   (carry .wheels for gpu_run.sh's peers)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
T0=$(date +%s)
STAGES="" bash benchmarks/gpu_run.sh > "$OUT/build.log" 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
echo "build done at $(( $(date +%s) - T0 )) s" >> "$OUT/build.log"
timeout -s INT 200 python3 -m pytest -q -n 8 -rfE -p no:cacheprovider tests/test_attention.py tests/test_cudagraphs.py \
  > "$OUT/pytest.txt" 2>&1; echo "pytest rc=$? at $(( $(date +%s) - T0 )) s" >> "$OUT/pytest.txt"
tail -3 "$OUT/pytest.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20
R=$OUT/ab.txt
echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader) commit ${PYKERNELS_COMMIT:-?} $(date -u)" > "$R"
B=benchmarks/dev/attention_dropout_kernels.py
for r in 1 2; do
  echo "## round $r: default (the ordered walk)" >> "$R"
  timeout 90 python3 $B order --cases bert_pad,bert_varlen,d128_varlen --iters 10 --peers >> "$R" 2>&1
  echo "## round $r: PYKERNELS_CUDA_ATTN_FWD_ORDER=0 (tile_at's walk)" >> "$R"
  PYKERNELS_CUDA_ATTN_FWD_ORDER=0 timeout 80 python3 $B rr --cases bert_pad,bert_varlen,d128_varlen \
    --iters 10 >> "$R" 2>&1
done
echo "bench done at $(( $(date +%s) - T0 )) s" >> "$OUT/build.log"
grep -v "^ \|Warn\|warn" "$R" | grep -v "sdpa-flash\|sdpa-eff\|not run"
