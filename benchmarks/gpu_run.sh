#!/usr/bin/env bash
# The one GPU job: install, run the test suite natively on the GPU, then every benchmark against its
# peers, all in one call on the device machine. Results land in $OUT (at most 8 files come back):
#   env.txt pytest.txt host.txt bench.log attention.csv layer_norm.csv cross_entropy.csv masked_lm_loss.csv
#   train_step.csv (its table is in bench.log too): nine files with every stage, one over that limit, so a call
#   that needs them all tars $OUT
# PYKERNELS_COMMIT names the commit in every result row (the device copy has no .git).
# Usage: STAGES="tests bench" TEST_TIMEOUT=300 BENCH_ARGS="" bash benchmarks/gpu_run.sh
# STAGES may also name "matrix": benchmarks/attention.py --matrix (the shapes beyond the anchors; MATRIX_ARGS, e.g.
# "--only d256_causal,d192_bidir"), written to $OUT/matrix.log and attention_matrix.csv (not in the default stages).
# Peers Liger-Kernel and Cut Cross-Entropy come as wheels in .wheels/ (carried; the machine reaches
# no registry) and are unpacked to /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
STAGES=${STAGES-"tests host demo bench"}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-200}
PY=${PY:-python3}

{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $PY -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0], 'cudnn', torch.backends.cudnn.version())"
  $PY -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1

# peers' wheels: .wheels/ (copy ../shared/wheels/*.whl there and carry it to the device), else ../shared/wheels
WHEELS=.wheels
ls $WHEELS/*.whl >/dev/null 2>&1 || WHEELS=../shared/wheels
if ls $WHEELS/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site $WHEELS/*.whl >>"$OUT/env.txt" 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -m pip install -q --no-build-isolation --no-deps -e . >>"$OUT/env.txt" 2>&1 || echo "pip install -e . failed" >>"$OUT/env.txt"
$PY -c "import pykernels; print(pykernels.backends())" >>"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [[ " $STAGES " == *" tests "* ]]; then
  echo "== tests (GPU, native Triton) =="
  timeout "$TEST_TIMEOUT" $PY -m pytest -q -rfEs -p no:cacheprovider --durations=15 ${TEST_ARGS:-tests} >"$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?" >>"$OUT/pytest.txt"
  grep -E "passed|failed|error|rc=" "$OUT/pytest.txt" | tail -5
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -40
fi

if [[ " $STAGES " == *" host "* ]]; then
  echo "== host overhead per call =="
  timeout 120 $PY benchmarks/dev/host_overhead.py >"$OUT/host.txt" 2>&1
  head -12 "$OUT/host.txt"
fi

if [[ " $STAGES " == *" demo "* ]]; then
  echo "== make demo's report (benchmarks/report.py) ==" | tee "$OUT/demo.log"
  timeout 240 $PY benchmarks/report.py 2>&1 | tee -a "$OUT/demo.log" | tail -12
fi

if [[ " $STAGES " == *" bench "* ]]; then
  echo "== benchmarks ==" | tee "$OUT/bench.log"
  [ -f "$OUT/demo.log" ] && cat "$OUT/demo.log" >>"$OUT/bench.log" && rm "$OUT/demo.log"
  for op in ${BENCH_OPS:-layer_norm cross_entropy masked_lm_loss attention train_step}; do
    echo "-- $op" | tee -a "$OUT/bench.log"
    timeout "$BENCH_TIMEOUT" $PY benchmarks/$op.py ${BENCH_ARGS:-} >>"$OUT/bench.log" 2>&1
    echo "$op rc=$?" | tee -a "$OUT/bench.log"
  done
  tail -c 6000 "$OUT/bench.log"
fi

if [[ " $STAGES " == *" matrix "* ]]; then
  echo "== attention matrix (benchmarks/attention.py --matrix) =="
  timeout "$BENCH_TIMEOUT" $PY benchmarks/attention.py --matrix --budget-s $(( BENCH_TIMEOUT - 20 )) ${MATRIX_ARGS:-} \
    >"$OUT/matrix.log" 2>&1
  echo "matrix rc=$?" | tee -a "$OUT/matrix.log"
  grep -E "^\[" "$OUT/matrix.log"
fi
