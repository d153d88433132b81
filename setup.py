"""Installs one package, `tfx_gradient_accumulator`: the library (`.accumulator`), the TFX
Trainer (`.components`) and the demo pipelines (`.pipelines`).

Layout (no symbolic links): `package_dir` maps the package to `src/tfx_gradient_accumulator/`
(its `__init__.py` alone) and each sub-package to its top-level folder (`accumulator/`, ...).
Why: one import path per file in editable and wheel installs (setuptools' editable finder
maps each name to its folder; no folder at the root is named `tfx_gradient_accumulator`), so
tracebacks, coverage and editors show the file you edit, and nothing loads twice.

The wheel holds `tfx_gradient_accumulator/{__init__.py,accumulator,components,pipelines}`
and nothing else. The sdist holds what builds that wheel (setup.py, pyproject.toml,
README.md, src/, the three folders) and leaves `tests/` out on purpose (MANIFEST.in): the
tests need the checkout (docs/, benchmarks/, constraints/, the Makefile), so they run from
a clone, not from the sdist."""

import pathlib
import re

from setuptools import find_packages, setup

PACKAGE = "tfx_gradient_accumulator"
INSTALLED = ("accumulator", "components", "pipelines")   # top-level folders, as PACKAGE.<folder>
PACKAGE_DIR = {PACKAGE: f"src/{PACKAGE}", **{f"{PACKAGE}.{folder}": folder for folder in INSTALLED}}
PACKAGES = [PACKAGE] + [f"{PACKAGE}.{folder}" + (f".{sub}" if sub else "")
                        for folder in INSTALLED for sub in ["", *find_packages(folder)]]

# Supported = tested by `make test`. Keras 3: the oldest pair (constraints/oldest.txt,
# TF 2.16 + Keras 3.8), the TFX 1.16 stack and the newest pair (constraints/tf-latest.txt).
# Keras 2: TF 2.15's built-in Keras 2.15 (constraints/keras2-tf215.txt) and tf_keras on
# the newest TF (constraints/keras2-latest.txt). Keras 3.0-3.7 train differently under
# tf.distribute and mixed precision, hence excluded.
OLDEST_KERAS_3 = (3, 8)
KERAS = "keras>=2.15," + ",".join(f"!=3.{minor}.*" for minor in range(OLDEST_KERAS_3[1])) + ",<3.16"

# The version is written once, as the library's `__version__`; the distribution reads it there.
VERSION = re.search(r'^__version__ = "([^"]+)"$',
                    (pathlib.Path(__file__).parent / "accumulator" / "__init__.py").read_text(encoding="utf-8"),
                    re.M).group(1)

setup(
    name="tfx-gradient-accumulator",
    version=VERSION,
    description=(
        "Exact gradient accumulation for TensorFlow 2 / Keras 3 and Keras 2, "
        "packaged as a TFX Trainer component."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    package_dir=PACKAGE_DIR,
    packages=PACKAGES,
    python_requires=">=3.9,<3.14",
    # No TensorFlow here: an extra chooses which one, so that an install holds exactly one.
    # `tensorflow` and `tensorflow-cpu` are two distributions of one import package; a
    # requirement on `tensorflow` beside a user's `tensorflow-cpu` installed both, the second
    # overwriting the first's files. Without an extra, the package takes the TensorFlow
    # already installed (or `tfx`'s); importing it with none names these extras.
    install_requires=[KERAS],
    extras_require={
        # One TensorFlow each, all 2.15 to 2.21 (the range `make test` runs). tensorflow-cpu
        # has wheels for x86-64 only (Linux, Windows; macOS up to 2.16): elsewhere (Apple
        # silicon, Linux aarch64) `[cpu]` takes `tensorflow`, the one build there.
        "tensorflow": ["tensorflow>=2.15,<2.22"],
        "cpu": ['tensorflow-cpu>=2.15,<2.22; platform_machine == "x86_64" or platform_machine == "AMD64"',
                'tensorflow>=2.15,<2.22; platform_machine != "x86_64" and platform_machine != "AMD64"'],
        "and-cuda": ["tensorflow[and-cuda]>=2.15,<2.22"],
        # Keras 2 on TF >= 2.16 (TF 2.15's tf.keras is Keras 2 already). tf_keras itself asks
        # for the full `tensorflow` of its own minor version: beside `[cpu]`, install it
        # `--no-deps` (docs/install.md).
        "keras2": ["tf_keras>=2.16,<2.22"],
        # accumulator.tuning: accumulation as KerasTuner hyperparameters. KerasTuner
        # imports TensorBoard, which TensorFlow >= 2.21 no longer installs.
        "tuning": ["keras-tuner>=1.4", "tensorboard"],
        # The TFX 1.16 stack; install with constraints/tfx-1.16.txt (see README). TFX brings
        # its own TensorFlow (`tensorflow` 2.16): no TensorFlow extra beside this one.
        "tfx": ["tfx==1.16.0", "kfp-pipeline-spec==0.7.0", "scikit-learn"],
        "test": ["pytest>=7", "pytest-timeout", "portpicker"],
        "bench": ["matplotlib"],
        # The manual (`make docs`: MkDocs, Material theme, API reference from docstrings).
        # Ruff formats the API signatures (mkdocstrings leaves them one clipped line without it).
        "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10", "mkdocstrings[python]>=0.26", "ruff"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
