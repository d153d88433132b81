"""What `make bench` measures, shared by the runner and the report (no TensorFlow at import).

`run.py` runs the parts in this order and the report lists their timings in it;
the memory part's contenders and the overhead part's fixed workload are named
once here so that the runner, the plots and the report cannot disagree.
"""

PARTS = ["throughput", "noise_scale", "overhead", "kernel_count", "memory", "distributed", "leak", "auto_batch"]

MEMORY_CONTENDERS = ["plain_b", "accumulator", "keras_builtin", "plain_b_mirrored", "accumulator_mirrored"]
OVERHEAD_WORKLOAD, OVERHEAD_ACCUM = "tiny_cnn", 4
