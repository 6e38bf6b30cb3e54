set -u
export PYKERNELS_SKIP_CUDA_BUILD=1
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.txt 2>&1 || echo install failed
timeout 500 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE tests > $OUT/pytest_all.txt 2>&1; echo "rc=$?" >> $OUT/pytest_all.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_all.txt | head -20; tail -2 $OUT/pytest_all.txt
