#!/usr/bin/env bash
# Issue 13 on the lent GPU machine, one device call per mode, after the GPU kit's
# `finish` (../shared/gpu/README.md; the call plan is in DEVELOPERS.md, "On a lent GPU"):
#
#   run(carry=[".gpu/kit"], command="bash .gpu/kit/finish && . /tmp/gpu-env.sh && bash tools/gpu_session.sh check")
#   run(carry=[".gpu/kit"], command="... && bash tools/gpu_session.sh bench --parts=throughput --workloads=transformer")
#
# check [PYTEST ARGS]: environment facts and what jit_compile="auto" resolves to
#   ($OUT/environment.json), then the one-device tests of tests/accumulator under
#   Keras' defaults, the exactness and mixed-precision files first, each test's
#   outcome and max |Δw| in $OUT/deltas.json (rewritten after every test, so a run
#   cut short keeps what it measured), the log in $OUT/check.log.
# bench [BENCHMARK ARGS]: `python -m benchmarks.run ARGS`; its folder
#   docs/benchmarks/gpu-<device>/ comes back as $OUT/bench-results.tar, the log as
#   $OUT/bench.log. Unpack the tar into docs/benchmarks/ here before the next bench
#   call: the folder then travels with the tree and the next part is merged into it.
#
# CHECK_SECONDS (default 500) and BENCH_SECONDS (default 540) stop a mode inside the
# device's 600 s per call, with what it measured so far.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT, the folder whose files come back}"
mode=${1:-}; shift || true
# The driver JIT-compiles TensorFlow's PTX for Hopper on first use: keep its cache
# across the processes of one held machine.
export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296} CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/cuda-cache}
export KERAS_BACKEND=tensorflow PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
python=${PYTHON:-python3}
# The package as the wheel holds it (the checkout's root has no tfx_gradient_accumulator/
# folder: setup.py maps it), copied outside the tree: this machine cannot pip install it.
"$python" -m tools.stage_package /tmp/tfx-package || exit 1
export PYTHONPATH=/tmp/tfx-package${PYTHONPATH:+:$PYTHONPATH}

case "$mode" in
  check)
    "$python" -m tools.gpu_probe --out="$OUT/environment.json" 2>&1 | tee "$OUT/check.log"
    # Exactness first: a run stopped by CHECK_SECONDS keeps these.
    files=(test_exactness test_mixed_precision test_xla test_sparse test_window test_weighting test_callbacks
           test_noise_scale test_batch_norm test_saving test_optimizer test_api)
    files=("${files[@]/#/tests/accumulator/}")
    timeout "${CHECK_SECONDS:-500}" "$python" -m pytest -p no:cacheprovider -o addopts="" -q -ra --timeout=300 \
      --record-deltas="$OUT/deltas.json" "${files[@]/%/.py}" "$@" 2>&1 | tee -a "$OUT/check.log"
    status=${PIPESTATUS[0]}
    [ "$status" = 124 ] && echo "stopped after ${CHECK_SECONDS:-500} s: $OUT/deltas.json holds the tests that ended" \
      | tee -a "$OUT/check.log"
    exit "$status";;
  bench)
    # BENCH_OUT: the results' root (default docs/benchmarks; one per configuration of a
    # lease, e.g. XLA on and off); BENCH_TAG names the tar and the log that come back.
    root=${BENCH_OUT:-docs/benchmarks}; tag=${BENCH_TAG:+-$BENCH_TAG}
    mkdir -p "$root"
    # Each measurement stops 60 s before the mode's limit, keeping its completed rounds,
    # so that the report is still written.
    seconds=${BENCH_SECONDS:-540}
    timeout "$seconds" "$python" -m benchmarks.run --out="$root" --measure_seconds=$((seconds - 60)) "$@" 2>&1 \
      | tee "$OUT/bench$tag.log"
    status=${PIPESTATUS[0]}
    # Whatever was written, also after a failure in the plots: results.json is saved first.
    folders=$(cd "$root" && ls -d gpu-* 2>/dev/null)
    [ -n "$folders" ] && tar -C "$root" -cf "$OUT/bench-results$tag.tar" $folders
    exit "$status";;
  *)
    echo "usage: OUT=folder tools/gpu_session.sh check [pytest args] | bench [benchmarks.run args]" >&2
    exit 2;;
esac
