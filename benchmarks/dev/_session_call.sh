set -u
export PYKERNELS_SKIP_CUDA_BUILD=1
export PYKERNELS_COMMIT=$(cat .commit)
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.txt 2>&1 || echo install failed
timeout 200 python3 -m pytest -q -n 4 -p no:cacheprovider -rfE tests/test_attention.py -k "varlen or sm90_gluon_forward or sm90_host or sm90_forward_in_cuda_graph or sm90_dispatch" > $OUT/pytest_varlen.txt 2>&1; echo "rc=$?" >> $OUT/pytest_varlen.txt
grep -E "^(FAILED|ERROR)|Error" $OUT/pytest_varlen.txt | head -20; tail -2 $OUT/pytest_varlen.txt
timeout 120 python3 benchmarks/dev/attention_varlen_ab.py > $OUT/varlen_ab.txt 2>&1; echo "rc=$?" >> $OUT/varlen_ab.txt
cat $OUT/varlen_ab.txt
STAGES="bench" BENCH_OPS="attention" BENCH_TIMEOUT=240 bash benchmarks/gpu_run.sh > $OUT/gpu_run_stdout.txt 2>&1
grep -E "^(bert|gpt2|causal|bidir)" $OUT/bench.log | grep -E "pykernels|cudnn|flex" | cut -c1-200 | head -30
