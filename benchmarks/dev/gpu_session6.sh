# Session 6's first device call: the Gluon warp-specialised experiments (no C++ build needed).
set -u
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/env.txt
PYKERNELS_SKIP_CUDA_BUILD=1 python3 -m pip install -q --no-build-isolation --no-deps -e . >> $OUT/env.txt 2>&1
for k in ${KINDS:-ws pp}; do
  timeout -k 10 ${T_ATTN:-170} python3 -u benchmarks/dev/attention_sm90_gluon_ws.py --kernel $k > $OUT/attn_$k.txt 2>&1
  echo rc=$? >> $OUT/attn_$k.txt; echo "== $k"; grep -v "^D.*: ok" $OUT/attn_$k.txt | tail -30
done
[ -z "${SKIP_MLM:-}" ] && timeout -k 10 100 python3 -u benchmarks/dev/mlm_logits_sm90_gluon_ws.py > $OUT/mlm_ws.txt 2>&1; echo rc=$? >> $OUT/mlm_ws.txt
tail -20 $OUT/mlm_ws.txt
