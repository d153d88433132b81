"""TFX's own penguin Keras module and data, as the installed `tfx` package ships them.

`module(folder)` copies `tfx/examples/penguin/penguin_utils_keras.py` and the
`penguin_utils_base.py` it imports into `folder`, changed only so that two runs
see the same examples in the same order and start from the same weights:

* `penguin_utils_base.input_fn`: `shuffle=False` in its `TensorFlowDatasetOptions`;
* `penguin_utils_keras._make_keras_model`: `keras.utils.set_random_seed(0)` first;
* `penguin_utils_keras` imports the changed copy of `penguin_utils_base` beside it
  (`import penguin_utils_base as base`), so `folder` goes on the replicas' PYTHONPATH.

Everything else (its `tf.keras` model, `MirroredStrategy()` in run_fn, the
TensorBoard callback, `tf.saved_model.save` with Transform's serving signatures,
`preprocessing_fn`) is TFX's. `transform(...)` runs TFX's Transform executor on
the penguin data of `tfx/components/testdata/penguin` (train and eval splits,
with its schema).
"""

import os

from tests.components import shipped

EXAMPLE = os.path.join(shipped.PACKAGE, "examples", "penguin")
DATA = os.path.join(shipped.PACKAGE, "components", "testdata", "penguin")

CHANGES = {
    "penguin_utils_base.py": [
        ("batch_size=batch_size, label_key=transformed_name(_LABEL_KEY)),",
         "batch_size=batch_size, label_key=transformed_name(_LABEL_KEY), shuffle=False),"),
    ],
    "penguin_utils_keras.py": [
        ("from tfx.examples.penguin import penguin_utils_base as base",
         "import penguin_utils_base as base"),
        ("  inputs = [\n      keras.layers.Input(",
         "  keras.utils.set_random_seed(0)\n  inputs = [\n      keras.layers.Input("),
    ],
}


def module(folder):
    """The changed copy of TFX's penguin Keras module in `folder`; returns its path."""
    return shipped.changed_copy(EXAMPLE, CHANGES, folder)["penguin_utils_keras.py"]


def transform(module_file, root):
    """TFX's Transform executor over the shipped penguin data; returns
    (transformed examples, transform graph) artifacts."""
    from tfx.components.transform import executor as transform_executor
    from tfx.dsl.components.base import base_beam_executor
    from tfx.types import artifact_utils, standard_artifacts, standard_component_specs as keys

    def artifact(kind, path, splits=None):
        made = kind()
        made.uri = path
        if splits:
            made.split_names = artifact_utils.encode_split_names(splits)
        return made

    examples = artifact(standard_artifacts.Examples, os.path.join(DATA, "data"), ["train", "eval"])
    schema = artifact(standard_artifacts.Schema, os.path.join(DATA, "schema"))
    transformed = artifact(standard_artifacts.Examples, os.path.join(root, "transformed"))
    graph = artifact(standard_artifacts.TransformGraph, os.path.join(root, "graph"))
    context = base_beam_executor.BaseBeamExecutor.Context(
        beam_pipeline_args=[], tmp_dir=os.path.join(root, "tmp"), unique_id="1")
    transform_executor.Executor(context).Do(
        {keys.EXAMPLES_KEY: [examples], keys.SCHEMA_KEY: [schema]},
        {keys.TRANSFORM_GRAPH_KEY: [graph], keys.TRANSFORMED_EXAMPLES_KEY: [transformed]},
        {keys.MODULE_FILE_KEY: module_file, keys.DISABLE_STATISTICS_KEY: True})
    return transformed, graph


def raw_eval_examples(count=16):
    """Serialized raw eval examples (what the serving signature parses)."""
    return shipped.raw_examples(os.path.join(DATA, "data", "Split-eval"), count)
