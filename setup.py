"""Installs `accumulator` (the library), `components` (the TFX Trainer) and `pipelines`."""

from setuptools import find_packages, setup

setup(
    name="tfx-gradient-accumulator",
    version="0.1.0",
    description=(
        "Exact gradient accumulation for TensorFlow 2 / Keras 3, "
        "packaged as a TFX Trainer component."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["accumulator*", "components*", "pipelines*", "GradientAccumulator"]),
    python_requires=">=3.9",
    # Supported = tested by `make test`: the oldest pair (constraints/oldest.txt),
    # the TFX 1.16 stack and the newest pair (constraints/tf-latest.txt).
    install_requires=["tensorflow>=2.16,<2.22", "keras>=3.8,<3.16"],
    extras_require={
        # The TFX 1.16 stack; install with constraints/tfx-1.16.txt (see README).
        "tfx": ["tfx==1.16.0", "kfp-pipeline-spec==0.7.0", "scikit-learn"],
        "test": ["pytest>=7", "pytest-timeout", "portpicker"],
        "bench": ["matplotlib"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
