set -u
export PYKERNELS_SKIP_CUDA_BUILD=1
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.txt 2>&1 || echo install failed
timeout 480 python3 -m pytest -q -n 8 -p no:cacheprovider -rfEs tests > $OUT/pytest_all.txt 2>&1; echo "rc=$?" >> $OUT/pytest_all.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_all.txt | head -20; tail -3 $OUT/pytest_all.txt
grep -cE "^SKIPPED" $OUT/pytest_all.txt; grep -E "^SKIPPED" $OUT/pytest_all.txt | sed 's/\[[0-9]*\] //' | cut -c1-150 | sort | uniq -c | sort -rn | head -12
