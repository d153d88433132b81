"""The seam to Keras: private names in one module, hooks installed once, reversible, opt-out."""

import os
import pathlib
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator, hooks
from tfx_gradient_accumulator.accumulator.core import flavours, seam
from tests.accumulator import reference as ref

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBRARY = [p for folder in ("accumulator", "components", "pipelines") for p in (ROOT / folder).rglob("*.py")]
PRIVATE_MODULES = re.compile(r"keras\.src\b|tensorflow\.python\b|__internal__|from keras\.src|keras_core")
# TFX's executor API for subclasses (not Keras or TensorFlow), and namedtuple's.
ALLOWED_FOREIGN = {"_log_startup", "_GetFnArgs", "_GetExecutorClass", "_replace"}
# `_maybe_symbolic_build` (fixed by "symbolic_build") arrived in Keras 3.5.
# The Keras 2 hooks exist where tf_keras is installed.
EXPECTED_HOOKS = sorted(
    h for h in hooks.HOOKS
    if (h != "symbolic_build" or next(n for n in seam.PRIVATE_NAMES if n.path.endswith("_maybe_symbolic_build")).expected())
    and (not h.startswith("keras2_") or flavours.keras2_module() is not None)
)


def _own_private_names(sources):
    """Underscore names this project defines itself (methods, attributes, module names)."""
    defined = {p.stem for p in LIBRARY if p.stem.startswith("_")}     # our modules: accumulator.core._tf
    for text in sources:
        defined |= set(re.findall(r"(?:def|class)\s+(_\w+)", text))
        defined |= set(re.findall(r"\.(_\w+)\s*=[^=]", text))
        defined |= set(re.findall(r"^(_\w+)\s*=", text, re.M))
        defined |= set(re.findall(r"\b(_\w+)=", text))          # _untracked(_name=...)
    return defined


def test_no_private_keras_or_tensorflow_name_outside_the_seam():
    sources = {p: p.read_text() for p in LIBRARY}
    defined = _own_private_names(sources.values())
    found = []
    for path, text in sources.items():
        if path.name == "seam.py":
            continue
        code = "\n".join(line.split("#")[0] for line in text.splitlines())
        for match in PRIVATE_MODULES.finditer(code):
            found.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
        for name in re.findall(r"\.(_[a-zA-Z]\w*)", code):
            if name not in defined and name not in ALLOWED_FOREIGN:
                found.append(f"{path.relative_to(ROOT)}: .{name}")
    assert not found, "private Keras/TF names outside accumulator/core/seam.py:\n" + "\n".join(sorted(set(found)))


@pytest.mark.parametrize("name", seam.PRIVATE_NAMES, ids=str)
def test_each_private_name_the_seam_uses_exists(name):
    if not name.expected():
        pytest.skip(f"{name}: no Keras 2 installed here" if name.keras2 else
                    f"{name} arrived in Keras {'.'.join(map(str, name.since))}; this is {keras.__version__}")
    try:
        name.resolve()
    except (AttributeError, ImportError) as err:
        pytest.fail(f"{name} (needed for {name.needed_for}) is missing in Keras "
                    f"{keras.__version__} / TF {tf.__version__}: {err}")


def test_the_seam_docstring_lists_every_private_name():
    doc = seam.__doc__
    for name in seam.PRIVATE_NAMES:
        assert name.path.split(".")[-1] in doc, name


def _keras_functions():
    from keras.src.backend.tensorflow import trainer as tf_trainer  # the functions the hooks replace

    return {
        "fit": keras.Model.fit, "compute_loss": keras.Model.compute_loss, "compile": keras.Model.compile,
        "symbolic_build": getattr(tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build", None),
        "reduce_per_replica": tf_trainer.reduce_per_replica, "scope": tf.distribute.Strategy.scope,
        "model_dict": dict(vars(keras.Model)), "trainer_dict": dict(vars(tf_trainer.TensorFlowTrainer)),
    }


def test_constructing_compiling_and_fitting_change_no_keras_function():
    before = _keras_functions()
    x, y = ref.regression_data(64)
    with tf.distribute.MirroredStrategy(cross_device_ops=tf.distribute.ReductionToOneDevice()).scope():
        model = ref.mlp()
        model.compile(GradientAccumulator(keras.optimizers.Adam(), 4, partial_window="carry"), "mse")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    model.evaluate(x, y, verbose=0)
    assert _keras_functions() == before


def test_uninstall_restores_keras_and_install_is_idempotent():
    from keras.src.backend.tensorflow import trainer as tf_trainer

    assert hooks.installed_hooks() == EXPECTED_HOOKS
    wrapped_fit = keras.Model.fit
    try:
        hooks.uninstall()
        assert hooks.installed_hooks() == []
        assert "fit" not in vars(keras.Model) and "compute_loss" not in vars(keras.Model)
        assert keras.Model.fit is tf_trainer.TensorFlowTrainer.fit
        assert keras.Model.compute_loss is keras.src.trainers.trainer.Trainer.compute_loss
    finally:
        hooks.install()
        hooks.install()
    assert hooks.installed_hooks() == EXPECTED_HOOKS
    assert keras.Model.fit.__wrapped__ is wrapped_fit.__wrapped__


def test_unknown_hook_name_is_refused():
    with pytest.raises(ValueError, match="`hooks` must be a subset of"):
        hooks.install(["fit", "train_step"])


def _python(code, **env):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env=dict(os.environ, **env))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_import_installs_the_hooks_and_the_environment_can_opt_out():
    # This process imported the library as a user's does (the hooks installed at import);
    # the opt-out is read at import, so it takes a fresh process.
    assert hooks.installed_hooks() == EXPECTED_HOOKS and "fit" in vars(keras.Model)
    code = ("import keras; from tfx_gradient_accumulator import accumulator; "
            "from tfx_gradient_accumulator.accumulator import hooks; "
            "print(hooks.installed_hooks(), 'fit' in vars(keras.Model), "
            "accumulator.schedules.callbacks.AccumulationSchedule.__name__)")
    assert _python(code, ACCUMULATOR_KERAS_HOOKS="0").split()[-3:] == ["[]", "False", "AccumulationSchedule"]


class OwnTrainStep(keras.Model):
    """A user's train_step with other local names: weighed through compute_loss."""

    def train_step(self, data):
        features, targets = data
        with tf.GradientTape() as tape:
            predictions = self(features, training=True)
            value = self.compute_loss(x=features, y=targets, y_pred=predictions)
        gradients = tape.gradient(value, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return {"loss": value}


def test_a_users_train_step_is_weighed_through_compute_loss():
    # 100 samples as 32, 32, 32, 4: one exact step on all 100.
    x, y = ref.regression_data(100)
    expected = ref.fit_large_batch(ref.mlp(), keras.optimizers.SGD(0.1), x, y, 100)
    base = ref.mlp()
    model = OwnTrainStep(base.inputs, base.outputs)
    model.compile(GradientAccumulator(keras.optimizers.SGD(0.1), 4), "mse")
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6


def test_without_the_hooks_micro_batches_weigh_one_each():
    # The same run, hooks off: the short micro-batch counts as much as a full one.
    x, y = ref.regression_data(100)
    expected = ref.fit_large_batch(ref.mlp(), keras.optimizers.SGD(0.1), x, y, 100)
    hooks.uninstall()
    try:
        model = ref.mlp()
        model.compile(GradientAccumulator(keras.optimizers.SGD(0.1), 4), "mse")
        model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    finally:
        hooks.install()
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) > 1e-4


def test_xla_under_a_multi_replica_strategy_is_refused_before_training():
    x, y = ref.regression_data(64)
    with tf.distribute.MirroredStrategy(cross_device_ops=tf.distribute.ReductionToOneDevice()).scope():
        model = ref.mlp()
        model.compile(GradientAccumulator(keras.optimizers.SGD(0.1), 4), "mse", jit_compile=True)
    before = model.get_weights()
    with pytest.raises(NotImplementedError, match="jit_compile=False"):
        model.fit(x, y, batch_size=16, verbose=0)
    assert ref.max_abs_diff(model.get_weights(), before) == 0.0


def test_xla_in_a_custom_strategy_loop_is_refused_with_the_message():
    strategy = tf.distribute.MirroredStrategy(cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        variable = keras.Variable(np.ones(3, "float32"))
        optimizer = GradientAccumulator(keras.optimizers.SGD(0.1), 2)
        optimizer.build([variable])

    @tf.function(jit_compile=True)
    def step():
        strategy.run(lambda: optimizer.apply([tf.ones(3)], [variable]))

    with pytest.raises(NotImplementedError, match="jit_compile=False"):
        step()


def test_an_unsupported_keras_is_refused_with_the_range(monkeypatch):
    monkeypatch.setattr(keras, "__version__", "3.7.0")
    with pytest.raises(RuntimeError, match=r"needs Keras >= 3\.8.*this is Keras 3\.7\.0"):
        GradientAccumulator(keras.optimizers.SGD(), 2)


def _setup_requirements():
    """install_requires as setup.py computes it (setup() itself not run)."""
    import setuptools

    captured = {}
    source = (ROOT / "setup.py").read_text().replace('open("README.md", encoding="utf-8").read()', '""')
    original = setuptools.setup
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    try:
        exec(compile(source, "setup.py", "exec"), {"__name__": "setup_probe", "__file__": str(ROOT / "setup.py")})
    finally:
        setuptools.setup = original
    return captured


def test_setup_declares_the_range_make_test_runs():
    from packaging.requirements import Requirement

    setup = _setup_requirements()
    requirements = {Requirement(r).name: Requirement(r).specifier for r in setup["install_requires"]}
    # TensorFlow's range is the `tensorflow` extra's (the extras that choose one share it: test_wheel.py).
    requirements["tensorflow"] = Requirement(setup["extras_require"]["tensorflow"][0]).specifier
    pins = {}
    for name in ("oldest", "tf-latest", "keras2-tf215", "keras2-latest", "tfx-1.16"):
        text = (ROOT / "constraints" / f"{name}.txt").read_text()
        pins[name] = {m.group(1): m.group(2) for m in re.finditer(r"^([\w-]+)==([\d.]+)", text, re.M)}
    # Every tested pin is declared; the versions just outside the tested range are not.
    for name, pinned in pins.items():
        tf_version = pinned.get("tensorflow-cpu") or pinned.get("tensorflow")
        if tf_version:
            assert tf_version in requirements["tensorflow"], (name, tf_version)
        if "keras" in pinned:
            assert pinned["keras"] in requirements["keras"], (name, pinned["keras"])
    assert "2.15.0" in requirements["keras"] and "2.15.1" in requirements["tensorflow"]
    for outside in ("3.7.0", "3.16.0", "2.14.0"):
        assert outside not in requirements["keras"], outside
    from tfx_gradient_accumulator.accumulator.optimizer import OLDEST_KERAS
    assert ".".join(map(str, OLDEST_KERAS)) == pins["oldest"]["keras"].rsplit(".", 1)[0]
    makefile = (ROOT / "Makefile").read_text()

    def recipe(target):   # the target's line and its recipe's lines
        return re.search(rf"^{target}:.*\n((?:\t.*\n)*)", makefile, re.M).group(0)

    lanes = {"test-tfx", "test-tfx-2", "test-latest", "test-latest-2", "test-latest-3", "test-oldest",
             "test-keras2-tf215", "test-keras2-latest"}
    # make test runs every lane (LANES), and make test-core every one but TFX's.
    assert "$(LANES)" in recipe("test")
    assert set(re.search(r"^LANES := (.*)$", makefile, re.M).group(1).split()) == lanes
    for target in lanes - {"test-tfx", "test-tfx-2"}:
        assert re.search(rf"(?<![\w-]){target}(?![\w-])", recipe("test-core")), target


def test_setup_admits_exactly_the_pythons_make_test_runs():
    """Every minor Python that python_requires admits has a make test environment, and no other."""
    from packaging.specifiers import SpecifierSet

    admitted = SpecifierSet(_setup_requirements()["python_requires"])
    makefile = (ROOT / "Makefile").read_text()
    tested = set(re.findall(r"^\w+_PY := (3\.\d+)$", makefile, re.M))
    tfx = re.search(r"sys\.version_info\[:2\] == \(3, (\d+)\)", makefile)
    tested.add(f"3.{tfx.group(1)}")
    assert tested == {f"3.{minor}" for minor in range(30) if f"3.{minor}" in admitted}, (tested, admitted)
    assert f"{sys.version_info[0]}.{sys.version_info[1]}" in tested
