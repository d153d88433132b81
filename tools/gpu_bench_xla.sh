#!/usr/bin/env bash
# One lease's benchmark for the GPU defaults (prepared here, run on the GPU machine
# after the kit's `finish`, as one call): the GPU-size Transformer's throughput
#   1. with XLA on (what Keras' jit_compile="auto" does on one GPU) at b = 32, fit
#      contenders (plain b, plain N·b, ours, ours + noise scale, Keras' built-in);
#   2. with XLA off at b = 128 (a micro-batch that fills the device), fit and
#      custom-loop contenders;
# each into its own results root, back as $OUT/bench-results-<tag>.tar.
set -u
cd "$(dirname "$0")/.."
: "${OUT:?set OUT, the folder whose files come back}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>&1
BENCH_JIT_COMPILE=true BENCH_OUT=/tmp/bench-xla BENCH_TAG=xla-b32 BENCH_SECONDS=${XLA_SECONDS:-300} \
  bash tools/gpu_session.sh bench --parts=throughput --workloads=transformer --accums=2,8 --rounds=2 \
  --contenders=plain_b,plain_Nb,accumulator,accumulator_noise_scale,keras_builtin
BENCH_JIT_COMPILE=false BENCH_MICRO_BATCH=128 BENCH_OUT=/tmp/bench-b128 BENCH_TAG=noxla-b128 \
  BENCH_SECONDS=${FILL_SECONDS:-220} \
  bash tools/gpu_session.sh bench --parts=throughput --workloads=transformer --accums=2,8 --rounds=2 \
  --contenders=plain_b,plain_Nb,accumulator,keras_builtin,plain_b_loop,seeds_loop,accumulator_loop
