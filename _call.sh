#!/usr/bin/env bash
set -u
export PYKERNELS_COMMIT=$(cat .commit)-fuseddq2
T0=$(date +%s)
el() { echo "$(( $(date +%s) - T0 )) s"; }
STAGES="" bash benchmarks/gpu_run.sh > $OUT/build.log 2>&1
export PYTHONPATH=/tmp/site
echo "build done $(el)"; grep -iE " error|failed" $OUT/build.log | head -5
timeout 120 python3 -m pytest -q -n 8 -p no:cacheprovider -rfEs tests/test_attention.py tests/test_cudagraphs.py -k "cuda_fused or dropout_and_determinism or cuda_backend_dense or backward_kernel_choice or cuda_backend_dropout or capture or graph" > $OUT/pytest.txt 2>&1
echo "pytest rc=$? $(el)"; grep -E "passed|failed" $OUT/pytest.txt | tail -2; grep -E "^(FAILED|ERROR)" $OUT/pytest.txt | head -20
run_k() { timeout 60 python3 benchmarks/dev/attention_dropout_kernels.py "$@" > $OUT/kernels_$1.txt 2>&1; echo "kernels $1 rc=$? $(el)"; grep -E "^$1 " $OUT/kernels_$1.txt; grep -E "attn_bwd_sm90|dq_convert|Fill" $OUT/kernels_$1.txt | head -4; }
PYKERNELS_CUDA_ATTN_FUSED_DQ=0 run_k pair --kernels
run_k v4 --kernels
PYKERNELS_CUDA_ATTN_DQ_RED=s run_k scalar --kernels
PYKERNELS_CUDA_ATTN_FUSED_DQ=a run_k alwaysv4 --kernels --peers
grep -E "^cuda-nodrop|^sdpa-cudnn" $OUT/kernels_alwaysv4.txt
timeout 110 python3 benchmarks/train_step.py --models bert gpt2 --graph --steps 10 > $OUT/train_fused.txt 2>&1
echo "train fused rc=$? $(el)"; grep -E "^(bert|gpt2) " $OUT/train_fused.txt
[ $(( $(date +%s) - T0 )) -lt 470 ] && PYKERNELS_CUDA_ATTN_FUSED_DQ=0 timeout 100 python3 benchmarks/train_step.py --models bert gpt2 --graph --steps 10 > $OUT/train_pair.txt 2>&1
echo "train pair rc=$? $(el)"; grep -E "^(bert|gpt2) " $OUT/train_pair.txt
