"""Beam's multi-process direct runner gives the data components the same outputs as the default runner.

The digits pipeline's data components (`pipelines.digits.pipeline.data_components`:
CsvExampleGen and StatisticsGen on Beam, SchemaGen after them) run twice on the
shipped digits, with the `beam_pipeline_args` that `run_local.py` passes by default
(in memory, one worker) and with `--beam_running_mode=multi_processing --beam_workers=2`,
into one ML Metadata store. Compared:

- the examples of each split as a multiset of serialized records: the records
  are the same, not their order (the default runner writes one file per split in
  the CSV's order; two workers write two files, each with part of the records);
- the schema: equal protos;
- the statistics: every field equal, the floats (means, standard deviations) up to
  rounding, as the workers sum in another order (they differ in the last bits).

The multi-process run must have started its SDK worker processes (the test sees
their pids and the options they were given) and split each split's records
between them, so the test fails if the flag does nothing; the Beam arguments are
part of TFX's cache key, so the second run executes anew rather than take the
first run's outputs from the cache.
"""

import glob
import json
import os
import re
import subprocess

import pytest
import tensorflow as tf
from absl import flags
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions
from apache_beam.runners.portability import local_job_service
from google.protobuf import json_format, text_format
from tensorflow_metadata.proto.v0 import schema_pb2, statistics_pb2
from tfx import v1 as tfx
from tfx.components.statistics_gen.executor import Executor as StatisticsGenExecutor
from tfx.dsl.components.base.base_beam_executor import BaseBeamExecutor
from tfx.orchestration.beam.beam_dag_runner import BeamDagRunner
from tfx.utils import dependency_utils

from tfx_gradient_accumulator.pipelines.digits.data import write_digits_csv
from tfx_gradient_accumulator.pipelines.digits.pipeline import data_components
from tfx_gradient_accumulator.pipelines import run_local
from tfx_gradient_accumulator.pipelines.run_local import beam_pipeline_args, latest_artifacts

WORKERS = 2
SPLITS = ("train", "eval")
DIGITS = 1797       # rows of the shipped CSV


@pytest.fixture
def sdk_workers(monkeypatch):
    """The SDK worker processes Beam starts (pid, their PIPELINE_OPTIONS), recorded as they start."""
    started = []

    class RecordingPopen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            super().__init__(args, *rest, **kwargs)
            if "apache_beam.runners.worker.sdk_worker_main" in str(args):
                started.append((self.pid, json.loads(kwargs["env"]["PIPELINE_OPTIONS"])))

    # Where Beam's SubprocessSdkWorker takes Popen from (the subprocess module itself).
    monkeypatch.setattr(local_job_service.subprocess, "Popen", RecordingPopen)
    return started


def _run(data_root, root, args):
    """Runs the data components with `args`; returns the new {type: artifact} and executions."""
    metadata_path = os.path.join(root, "metadata.sqlite")
    BeamDagRunner().run(tfx.dsl.Pipeline(
        pipeline_name="digits_data", pipeline_root=os.path.join(root, "pipeline_root"),
        components=list(data_components(data_root)), enable_cache=True,
        metadata_connection_config=tfx.orchestration.metadata.sqlite_metadata_connection_config(metadata_path),
        beam_pipeline_args=args,
    ))
    latest = latest_artifacts(metadata_path)
    return {name: latest(name) for name in ("Examples", "ExampleStatistics", "Schema")}


def _shards(examples, split):
    """The split's files, each as its list of serialized records."""
    files = sorted(glob.glob(os.path.join(examples.uri, f"Split-{split}", "*")))
    return [[r.numpy() for r in tf.data.TFRecordDataset(f, compression_type="GZIP")] for f in files]


def _statistics(statistics, split):
    stats = statistics_pb2.DatasetFeatureStatisticsList()
    with open(os.path.join(statistics.uri, f"Split-{split}", "FeatureStats.pb"), "rb") as f:
        stats.ParseFromString(f.read())
    return stats


def _schema(schema):
    with open(os.path.join(schema.uri, "schema.pbtxt")) as f:
        return text_format.Parse(f.read(), schema_pb2.Schema())


def _fields(message):
    """{path: value} of every field set in `message` (int64 fields as strings, doubles as floats)."""
    def walk(value, path):
        if isinstance(value, dict):
            for key, item in value.items():
                yield from walk(item, f"{path}.{key}")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                yield from walk(item, f"{path}[{i}]")
        else:
            yield path, value

    return dict(walk(json_format.MessageToDict(message), ""))


def _assert_same_statistics(expected, actual):
    assert len(expected.datasets) == len(actual.datasets) == 1
    assert expected.datasets[0].num_examples == actual.datasets[0].num_examples
    for one, other in zip(expected.datasets[0].features, actual.datasets[0].features):
        assert one.path == other.path
        assert one.num_stats.common_stats.num_non_missing == other.num_stats.common_stats.num_non_missing \
            == expected.datasets[0].num_examples
    want, got = _fields(expected), _fields(actual)
    assert want.keys() == got.keys()
    floats = {k for k, v in want.items() if isinstance(v, float)}
    assert {k: want[k] for k in want.keys() - floats} == {k: got[k] for k in got.keys() - floats}
    assert {k: got[k] for k in floats} == pytest.approx({k: want[k] for k in floats}, rel=1e-12, abs=1e-12)
    assert any(k.endswith(".mean") for k in floats)


@pytest.mark.apart      # 111 s; an option of run_local, whose default mode runs in make test
def test_multi_processing_gives_the_data_components_the_default_runners_outputs(tmp_path, sdk_workers):
    data_root = str(tmp_path / "data")
    write_digits_csv(data_root)
    root = str(tmp_path / "run")

    default = _run(data_root, root, beam_pipeline_args())
    assert sdk_workers == []                       # in memory: no worker process
    multi = _run(data_root, root, beam_pipeline_args("multi_processing", WORKERS))

    # Ran anew, with WORKERS worker processes for each of the two Beam components.
    assert all(multi[name].id != default[name].id for name in default)
    pids = {pid for pid, _ in sdk_workers}
    assert len(pids) == len(sdk_workers) == 2 * WORKERS and os.getpid() not in pids
    for _, options in sdk_workers:
        assert options["beam:option:direct_running_mode:v1"] == "multi_processing"
        assert int(options["beam:option:direct_num_workers:v1"]) == WORKERS

    total = 0
    for split in SPLITS:
        one, many = _shards(default["Examples"], split), _shards(multi["Examples"], split)
        assert len(one) == 1 and len(many) == WORKERS and all(many)   # each worker wrote a part
        records = one[0]
        assert sorted(records) == sorted(r for shard in many for r in shard)
        total += len(records)
        _assert_same_statistics(_statistics(default["ExampleStatistics"], split),
                                _statistics(multi["ExampleStatistics"], split))
    assert total == DIGITS
    assert _schema(default["Schema"]) == _schema(multi["Schema"])
    assert len(_schema(multi["Schema"]).feature) == 65


@pytest.mark.parametrize("arguments, expected", [
    ((), []),
    (("--beam_running_mode=multi_processing", "--beam_workers=2"),
     ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]),
    (("--beam_running_mode=multi_threading", "--beam_workers=3"),
     ["--direct_running_mode=multi_threading", "--direct_num_workers=3"]),
    (("--beam_running_mode=multi_processing",),
     ["--direct_running_mode=multi_processing", f"--direct_num_workers={os.cpu_count()}"]),
])
def test_the_flags_give_the_pipelines_beam_arguments(command_line, arguments, expected):
    command_line(*arguments)
    assert run_local._beam_args() == expected


def test_the_default_is_beams_own_and_spares_tfx_packing_itself(monkeypatch):
    """No arguments: Beam's direct runner in memory with one worker, as the flags say, and
    TFX's Beam components no longer pack TFX's source for a remote runner's workers."""
    options = PipelineOptions(beam_pipeline_args()).view_as(DirectOptions)
    assert (options.direct_running_mode, options.direct_num_workers) == ("in_memory", 1)
    packed = []
    monkeypatch.setattr(dependency_utils, "build_ephemeral_package", lambda: packed.append(1) or "tfx.tar.gz")
    StatisticsGenExecutor(BaseBeamExecutor.Context(beam_pipeline_args=beam_pipeline_args()))
    assert packed == []
    StatisticsGenExecutor(BaseBeamExecutor.Context(beam_pipeline_args=beam_pipeline_args("multi_threading", 2)))
    assert packed == [1]      # the control: with arguments, TFX packs itself


@pytest.mark.parametrize("arguments, message", [
    (("--beam_workers=0",), "--beam_workers=0: 0 is not a positive integer"),
    (("--beam_running_mode=multi_process",),
     "--beam_running_mode=multi_process: value should be one of <in_memory|multi_threading|multi_processing>"),
    (("--beam_workers=2",), "--beam_workers above 1 needs --beam_running_mode=multi_processing or multi_threading"),
])
def test_bad_beam_flags_are_refused_naming_the_flag(command_line, arguments, message):
    with pytest.raises(flags.IllegalFlagValueError, match=re.escape(message)):
        command_line(*arguments)


def test_beam_pipeline_args_refuses_what_the_runner_would_not_run():
    with pytest.raises(ValueError, match="one of in_memory, multi_threading, multi_processing"):
        beam_pipeline_args("multi_process", 2)
    with pytest.raises(ValueError, match="in_memory takes 1"):
        beam_pipeline_args("in_memory", 2)
    with pytest.raises(ValueError, match="in_memory takes 1"):
        beam_pipeline_args("multi_processing", 0)
