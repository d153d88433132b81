"""`make bench`: see benchmarks/run.py."""

import os
import subprocess


def allocator_statistics_on():
    """Call before TensorFlow is imported, in a process that reads memory figures
    (`tf.config.experimental.get_memory_info`): TensorFlow's CPU allocator keeps those
    statistics only under oneDNN's allocator, which it turns on by default on AVX-512
    CPUs alone (elsewhere `reset_memory_stats` fails)."""
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")


def accelerator_facts():
    """The first GPU's name, compute capability and memory, its driver, and the CUDA/cuDNN
    TensorFlow was built for (with the architectures it ships kernels for); {} without a GPU.
    Recorded in the benchmark results and by tools/gpu_probe.py."""
    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return {}
    details = tf.config.experimental.get_device_details(gpus[0])
    build = tf.sysconfig.get_build_info()
    facts = {"gpu": details.get("device_name"), "compute_capability": details.get("compute_capability"),
             "cuda_build": build.get("cuda_version"), "cudnn_build": build.get("cudnn_version"),
             "kernels_built_for": build.get("cuda_compute_capabilities")}
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=60)
        facts["driver"], facts["gpu_memory"] = [v.strip() for v in query.stdout.splitlines()[0].split(",")]
    except (OSError, IndexError, ValueError, subprocess.SubprocessError) as error:
        facts["driver"] = f"not read ({error.__class__.__name__})"
    return facts
