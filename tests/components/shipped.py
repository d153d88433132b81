"""TFX's own module files and test data, as the installed `tfx` package ships them.

A module file is used as TFX wrote it except for the few lines that make two runs
comparable (the same examples in the same order, the same initial weights):
`changed_copy` writes it into a test's folder with exactly those replacements and
fails if this tfx no longer has a line it replaces. `served` reads back what the
module's run_fn exported: its trainable variables and its serving signature's
outputs on raw examples.
"""

import importlib.util
import os

PACKAGE = os.path.dirname(importlib.util.find_spec("tfx").origin)


def changed_copy(source_folder, changes, folder):
    """Copies `{file name: [(old, new), ...]}` from `source_folder` into `folder`, each
    `old` (found exactly once) replaced by `new`; returns the copies' paths by name."""
    os.makedirs(folder, exist_ok=True)
    paths = {}
    for name, replacements in changes.items():
        with open(os.path.join(source_folder, name)) as f:
            source = f.read()
        for old, new in replacements:
            assert source.count(old) == 1, f"{name} of this tfx no longer has {old!r}"
            source = source.replace(old, new)
        paths[name] = os.path.join(folder, name)
        with open(paths[name], "w") as f:
            f.write(source)
    return paths


def served(model_uri, raw_examples):
    """(trainable variables sorted by name, serving_default's "outputs" on `raw_examples`)
    of the Keras 2 SavedModel the run_fn exported under `model_uri`."""
    import tensorflow as tf
    loaded = tf.saved_model.load(os.path.join(model_uri, "Format-Serving"))
    assert hasattr(loaded, "trainable_variables"), "not a Keras 2 (tf_keras) model's SavedModel"
    variables = [v.numpy() for v in sorted(loaded.trainable_variables, key=lambda v: v.name)]
    outputs = loaded.signatures["serving_default"](examples=raw_examples)["outputs"].numpy()
    return variables, outputs


def raw_examples(folder, count=16):
    """The first `count` serialized examples of the GZIP'd TFRecord files in `folder`."""
    import tensorflow as tf
    records = tf.data.TFRecordDataset([os.path.join(folder, f) for f in sorted(os.listdir(folder))],
                                      compression_type="GZIP")
    return tf.constant([r.numpy() for r in records.take(count)])
