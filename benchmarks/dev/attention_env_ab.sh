#!/usr/bin/env bash
# An A/B of one build's C++ attention under developer switches (environment variables), one device call: the build,
# the attention and graph tests, then attention_dropout_kernels.py under each variant, two rounds (the peers in the
# first variant's first round). Results under $OUT (build.log, pytest.txt, ab.txt). Each argument is a variant,
# "LABEL [VAR=VALUE ...]"; AB_CASES the cases (default: the packed BERT batch and its D = 128 twin, padded and packed);
# AB_TESTS=0 skips the tests; AB_ARGS more arguments for the benchmark (--kernels: each kernel's time).
# Usage (device, carry .wheels for gpu_run.sh's peers):
#   bash benchmarks/dev/attention_env_ab.sh default "rr PYKERNELS_CUDA_ATTN_FWD_ORDER=0"          (run307-310)
#   bash benchmarks/dev/attention_env_ab.sh tma "twin PYKERNELS_CUDA_ATTN_FUSED_DQ=c" "pair PYKERNELS_CUDA_ATTN_FUSED_DQ=0"
#                                                                                                  (run303)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
CASES=${AB_CASES:-bert_pad,bert_varlen,d128_pad,d128_varlen}
T0=$(date +%s)
STAGES="" bash benchmarks/gpu_run.sh > "$OUT/build.log" 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
echo "build done at $(( $(date +%s) - T0 )) s" >> "$OUT/build.log"
if [ "${AB_TESTS:-1}" != 0 ]; then
  timeout -s INT 200 python3 -m pytest -q -n 8 -rfE -p no:cacheprovider tests/test_attention.py tests/test_cudagraphs.py \
    > "$OUT/pytest.txt" 2>&1; echo "pytest rc=$? at $(( $(date +%s) - T0 )) s" >> "$OUT/pytest.txt"
  tail -3 "$OUT/pytest.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20
fi
R=$OUT/ab.txt
echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader) commit ${PYKERNELS_COMMIT:-?} $(date -u)" > "$R"
B=benchmarks/dev/attention_dropout_kernels.py
for r in 1 2; do
  first=1
  for variant in "$@"; do
    read -r label envs <<< "$variant"
    peers=""
    [ "$r" = 1 ] && [ "$first" = 1 ] && peers=--peers
    first=0
    echo "## round $r: $label ${envs:-(no switch)}" >> "$R"
    env $envs timeout 90 python3 $B "$label" --cases "$CASES" --iters 10 $peers ${AB_ARGS:-} >> "$R" 2>&1
  done
done
echo "bench done at $(( $(date +%s) - T0 )) s" >> "$OUT/build.log"
grep -v "^ \|Warn\|warn" "$R" | grep -v "sdpa-flash\|sdpa-eff\|not run"
