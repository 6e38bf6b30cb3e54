#!/usr/bin/env bash
# The C++ forward's timeline build (attention.cuh, FwdTrace) in a copy of the tree, next to the package's own build:
#   bash benchmarks/dev/attention_fwd_trace.sh build      # copy to /tmp/pk_trace, build there (a few minutes)
#   bash benchmarks/dev/attention_fwd_trace.sh run ARGS   # attention_fwd_trace.py ARGS on that copy
# The copy is not installed: ``run`` puts it first on PYTHONPATH (its kernels/ linked in as pykernels/_kernels, as
# setup.py's package_dir maps it), so a call can build it in the background while it tests and times the package's
# own build.
set -euo pipefail
cd "$(dirname "$0")/../.."
DST=${PK_TRACE_DIR:-/tmp/pk_trace}
case "${1:-}" in
  build)
    rm -rf "$DST" && mkdir -p "$DST"
    tar --exclude=./.git --exclude=./.venv --exclude='./build' --exclude='*.so' -cf - . | tar -xf - -C "$DST"
    cd "$DST" && PYKERNELS_NVCC_FLAGS=-DPYKERNELS_FWD_TRACE MAX_JOBS=${MAX_JOBS:-8} python3 setup.py -q build_ext --inplace
    ;;
  run)
    shift
    [ -e "$DST/pykernels/_kernels" ] || ln -s ../kernels "$DST/pykernels/_kernels"
    export PYTHONPATH=$DST${PYTHONPATH:+:$PYTHONPATH}
    cd /tmp && python3 -c "import pykernels; print('pykernels from', pykernels.__file__)"
    python3 "$DST/benchmarks/dev/attention_fwd_trace.py" "$@"
    ;;
  *) echo "usage: $0 build | run [attention_fwd_trace.py args]" >&2; exit 2 ;;
esac
