"""The benchmark report judges a GPU run by its own yardstick (built from synthetic figures, no training), and
says when a measurement was cut by its time limit (one real, tiny measurement)."""

import json
import pathlib
import subprocess
import sys

import pytest

from benchmarks import report as bench_report

GPU = {"gpu": "NVIDIA H200", "compute_capability": [9, 0], "cuda_build": "12.5.1", "cudnn_build": "9",
       "driver": "580.159.04", "gpu_memory": "143771 MiB"}


def _results(plain_nb_seconds, accelerator=None):
    """Two rounds at N=2 and N=8; plain b takes 1.0 s per segment, plain N·b `plain_nb_seconds`."""
    seconds = {}
    for n in (2, 8):
        seconds.update({f"plain_b@{n}": [1.0, 1.0], f"plain_Nb@{n}": list(plain_nb_seconds),
                        f"accumulator@{n}": [1.02, 1.01], f"keras_builtin@{n}": [1.03, 1.04]})
    throughput = {"workload": "transformer", "size": "gpu", "micro": 32, "accums": [2, 8],
                  "contenders": ["plain_b", "plain_Nb", "accumulator", "keras_builtin"], "segment_micro_steps": 40,
                  "warm_step_seconds": 0.025, "param_bytes": 2**20, "description": "a transformer",
                  "seconds": seconds, "did_not_fit": [], "build_seconds": {}, "load_start": [0.1, 0.1, 0.1],
                  "load_end": [0.2, 0.2, 0.2], "segment_load_1min": []}
    return {"date": "2026-11-22", "device": GPU["gpu"] if accelerator else "CPU (2 cores, x86_64)",
            "versions": {"tensorflow": "2.21.0", "keras": "3.15.1", "python": "3.12.3"}, "cpus": 16,
            "parts_run": ["throughput"], "part_seconds": {"throughput": 60.0},
            "part_dates": {"throughput": "2026-11-22"}, "accelerator": accelerator or {},
            "throughput": {"transformer": throughput}}


def _targets(report):
    return [line for line in report.splitlines() if line.startswith("| transformer")]


def test_gpu_report_judges_saturation_and_names_driver_and_build(tmp_path):
    # Same samples per segment; plain N·b takes 1.25 s: at b the GPU is already full.
    bench_report.write(_results([1.25, 1.25], GPU), str(tmp_path))
    report = (tmp_path / "results.md").read_text()
    assert "driver 580.159.04" in report and "CUDA 12.5.1" in report and "compute capability 9.0" in report
    saturation = [line for line in _targets(report) if "fills the GPU" in line]
    assert len(saturation) == 1 and "plain 8·b / plain b" in saturation[0], _targets(report)
    assert "0.800" in saturation[0] and "**met**" in saturation[0], saturation
    assert not any("compute-bound micro-step" in line for line in _targets(report))


def test_gpu_report_flags_a_micro_batch_that_leaves_the_gpu_idle(tmp_path):
    # plain N·b twice as fast per sample: b leaves the GPU half idle.
    bench_report.write(_results([0.5, 0.5], GPU), str(tmp_path))
    saturation = [line for line in _targets((tmp_path / "results.md").read_text()) if "fills the GPU" in line]
    assert "2.000" in saturation[0] and "**missed**" in saturation[0], saturation


def test_cpu_report_keeps_the_milliseconds_target(tmp_path):
    bench_report.write(_results([1.0, 1.0]), str(tmp_path))
    report = (tmp_path / "results.md").read_text()
    assert any("compute-bound micro-step (≥ 50 ms)" in line for line in _targets(report))
    assert not any("fills the GPU" in line for line in _targets(report))
    assert "Other processes share the 16 cores" in report


def test_embedding_memory_report_judges_the_extra_against_rows_and_finds_a_table_copy(tmp_path):
    """`benchmarks.embedding_memory.report` on made-up runs: the target is met when
    the accumulator's extra over the large batch is its rows, and a closing step that
    copies the table shows as a table's size above the large batch's step."""
    from benchmarks import embedding_memory as em

    def run(peaks, state, accum=4):
        return {"accum": accum, "peaks_mb": peaks, "held_mb": [0.0] * len(peaks), "state_mb": state,
                "device": "CPU:0", "table_mb": 64.0, "dense_param_mb": 0.0, "window_rows_mb": 2.0}

    runs = {"plain_b": [run([128.0] * 8, 128.0)],
            "accumulator": [run([0.5, 0.5, 0.5, 130.0] * 2, 130.0)],
            "accumulator_merged": [run([0.5, 0.5, 0.5, 128.0] * 2, 130.0)],
            "keras_builtin": [run([64.0, 128.0, 128.0, 128.0] * 2, 192.0)],
            "large_batch": [run([130.0] * 2, 128.0)]}
    text = em.report(runs, str(tmp_path))
    assert "Over the large batch itself: **met** (2.0" in text
    assert "a closing step peaks 0.0" in text
    runs["accumulator"] = [run([0.5, 0.5, 0.5, 194.0] * 2, 130.0)]      # a table copy at the close
    text = em.report(runs, str(tmp_path))
    assert "a closing step peaks 64.0" in text and "**missed**" in text
    assert (tmp_path / "embedding_memory.png").exists()


@pytest.mark.apart      # 60 s of a real cut measurement
def test_a_measurement_cut_by_its_time_limit_keeps_its_rounds_and_says_so(tmp_path):
    # A real measurement (a tiny model on CPU, many rounds asked) stopped after 40 s:
    # the rounds it completed come back marked "cut", and the report says so.
    root = pathlib.Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "benchmarks.run", "--parts=throughput", "--workloads=tiny_cnn",
                    "--accums=2", "--contenders=plain_b,accumulator", "--rounds=1000", "--measure_seconds=40",
                    f"--out={tmp_path}"], cwd=root, check=True, capture_output=True, timeout=600)
    measured = json.loads((tmp_path / "cpu" / "results.json").read_text())["throughput"]["tiny_cnn"]
    assert measured["cut"] is True
    rounds = measured["rounds_completed"]
    assert 1 <= rounds < 1000
    assert {len(v) for v in measured["seconds"].values()} == {rounds}
    assert "cut by its time limit" in (tmp_path / "cpu" / "results.md").read_text()


def test_bench_jit_compile_is_read_compiled_and_worded_from_one_table(tmp_path):
    from benchmarks.parts import jit_compile_setting, jit_compile_value

    assert jit_compile_setting({}) == "auto" and jit_compile_value("auto") == "auto"
    assert jit_compile_setting({"BENCH_JIT_COMPILE": " False "}) == "false" and jit_compile_value("false") is False
    assert jit_compile_value(jit_compile_setting({"BENCH_JIT_COMPILE": "true"})) is True
    with pytest.raises(ValueError, match=r"BENCH_JIT_COMPILE must be one of \['auto', 'false', 'true'\]; "
                                         r"received 'off'"):
        jit_compile_setting({"BENCH_JIT_COMPILE": "off"})
    results = _results([1.25, 1.25], GPU)
    for recorded, words in (("false", "`jit_compile=False (XLA off)`"), (None, '`jit_compile="auto"`')):
        if recorded:
            results["jit_compile"] = recorded
        else:
            results.pop("jit_compile", None)            # a run from before it was recorded
        bench_report.write(results, str(tmp_path))
        assert words in (tmp_path / "results.md").read_text()
