#!/usr/bin/env bash
# One lease's device script (run after the kit's `finish` and `. /tmp/gpu-env.sh`):
#   1. issue 45: the GPU-size Transformer's fit throughput with XLA on (Keras' "auto" on
#      one GPU) at N = 8: ours against Keras' built-in, one round (session 22's lease spent
#      305 s compiling 4 contenders and measured nothing: every kernel is JIT-compiled from
#      PTX on a fresh machine, and XLA compiles each contender);
#   2. issue 46: find_micro_batch at E = 1024 under Keras' defaults, its time, and fit's
#      throughput at the b it picks against b set by hand.
# Each part has its own time limit; what a part measured comes back even when cut.
set -u
cd "$(dirname "$0")/.."
: "${OUT:?set OUT, the folder whose files come back}"
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_CACHE_PATH=/tmp/cuda-cache KERAS_BACKEND=tensorflow PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>&1
BENCH_JIT_COMPILE=true BENCH_OUT=/tmp/bench-xla BENCH_TAG=xla-b32-n8 BENCH_SECONDS=${XLA_SECONDS:-330} \
  bash tools/gpu_session.sh bench --parts=throughput --workloads=transformer --accums=8 --rounds=${XLA_ROUNDS:-1} \
  --contenders=${XLA_CONTENDERS:-accumulator,keras_builtin}
export PYTHONPATH=/tmp/tfx-package:.${PYTHONPATH:+:$PYTHONPATH}
timeout "${PROBE_SECONDS:-150}" python3 -m tools.gpu_fit_probe --out="$OUT/fit_probe.jsonl" --updates=2 --by_hand=64,128,256 \
  --max_micro_batch=${PROBE_MAX:-256} \
  > "$OUT/fit_probe.log" 2>&1
echo "probe exit $?" >> "$OUT/fit_probe.log"
