"""What `make bench` measures, shared by the runner and the report (no TensorFlow at import).

`run.py` runs the parts in this order and the report lists their timings in it;
the memory part's contenders and the overhead part's fixed workload are named
once here so that the runner, the plots and the report cannot disagree.
"""

PARTS = ["throughput", "noise_scale", "overhead", "kernel_count", "probe_cost", "effective_batch", "memory", "distributed", "leak", "auto_batch"]

MEMORY_CONTENDERS = ["plain_b", "accumulator", "keras_builtin", "plain_b_mirrored", "accumulator_mirrored"]
OVERHEAD_WORKLOAD, OVERHEAD_ACCUM = "tiny_cnn", 4

# BENCH_JIT_COMPILE: the `jit_compile` every throughput contender compiles with, the one place
# its values live: the runner records the setting, the contenders compile with its value, the
# report words it. "false" turns XLA off for all alike (on one GPU Keras' "auto" turns it on,
# and the window refuses sparse rows inside XLA unless merge_duplicate_rows=True).
JIT_COMPILE = {"auto": ("auto", '"auto"'), "false": (False, "False (XLA off)"), "true": (True, "True")}


def jit_compile_setting(environ=None) -> str:
    """BENCH_JIT_COMPILE as results.json records it: "auto" (unset), "false" or "true".

    Raises:
        ValueError: another value, named with the allowed ones.
    """
    import os
    raw = (os.environ if environ is None else environ).get("BENCH_JIT_COMPILE", "auto")
    setting = raw.strip().lower()
    if setting not in JIT_COMPILE:
        raise ValueError(f"BENCH_JIT_COMPILE must be one of {sorted(JIT_COMPILE)}; received {raw!r}.")
    return setting


def jit_compile_value(setting: str):
    """What `compile(jit_compile=...)` gets for a recorded setting: "auto", False or True."""
    return JIT_COMPILE[setting][0]


def jit_compile_words(setting: str) -> str:
    """The report's words for a recorded setting (results of before it was recorded: "auto")."""
    return JIT_COMPILE.get(setting, JIT_COMPILE["auto"])[1]
