set -u
export PYKERNELS_COMMIT=52724ee
(time MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e .) > $OUT/build.txt 2>&1
tail -3 $OUT/build.txt
timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_attention.py tests/test_cross_entropy.py tests/test_masked_lm_loss.py tests/test_layer_norm.py tests/test_backend.py -k "cuda_backend or cuda_cover" > $OUT/pytest.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.txt | head -40
STAGES=bench BENCH_OPS=attention BENCH_ARGS="--quick --budget-s 170" BENCH_TIMEOUT=200 bash benchmarks/gpu_run.sh > $OUT/benchrun.txt 2>&1
grep -E "pykernels|cudnn" $OUT/bench.log | cut -c1-200 | head -30
