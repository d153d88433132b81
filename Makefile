# `make demo` runs the local pipeline, `make test` the whole test suite, `make bench`
# the benchmarks. Each sets up what it needs on a fresh machine first.
PYTHON ?= python3
VENV := .venv
LATEST := .venv-tf-latest
OLDEST := .venv-oldest
KERAS2_TF215 := .venv-keras2-tf215
KERAS2_LATEST := .venv-keras2-latest
PYTEST_ARGS ?=

export TF_CPP_MIN_LOG_LEVEL ?= 2
export KERAS_BACKEND := tensorflow
export PYTHONUNBUFFERED := 1

.PHONY: bench demo test test-tfx test-latest test-oldest test-keras2-tf215 test-keras2-latest \
	setup setup-latest setup-oldest setup-keras2 clean

# $(call core_venv,DIR,CONSTRAINTS): a venv with pinned TensorFlow/Keras, the test
# tools and the library (no TFX).
define core_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q --upgrade pip
	$(1)/bin/pip install -q -r $(2) pytest pytest-timeout portpicker
	$(1)/bin/pip install -q --no-deps -e .
	touch $(1)/.installed
endef

setup: $(VENV)/.installed
setup-latest: $(LATEST)/.installed
setup-oldest: $(OLDEST)/.installed
setup-keras2: $(KERAS2_TF215)/.installed $(KERAS2_LATEST)/.installed

# The TFX 1.16 stack. tfx's metadata says Python < 3.11 while its libraries ship
# 3.11 wheels, hence --ignore-requires-python; the constraints keep pip from
# backtracking.
$(VENV)/.installed: setup.py constraints/tfx-1.16.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "TFX 1.16 needs Python 3.11 here; got " + sys.version' 
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade "pip<25" setuptools wheel
	$(VENV)/bin/pip install -q --ignore-requires-python -c constraints/tfx-1.16.txt -e '.[tfx,test,bench]'
	touch $@

# The core library alone on the newest TensorFlow and Keras.
$(LATEST)/.installed: setup.py constraints/tf-latest.txt
	$(call core_venv,$(LATEST),constraints/tf-latest.txt)

# The core library alone on the oldest supported TensorFlow and Keras.
$(OLDEST)/.installed: setup.py constraints/oldest.txt
	$(call core_venv,$(OLDEST),constraints/oldest.txt)

# Keras 2 where it is built in: TF 2.15's tf.keras.
$(KERAS2_TF215)/.installed: setup.py constraints/keras2-tf215.txt
	$(call core_venv,$(KERAS2_TF215),constraints/keras2-tf215.txt)

# Keras 2 on the newest TensorFlow: tf_keras, with TF_USE_LEGACY_KERAS=1 for the tests.
$(KERAS2_LATEST)/.installed: setup.py constraints/keras2-latest.txt
	$(call core_venv,$(KERAS2_LATEST),constraints/keras2-latest.txt)

# The main job: the digits pipeline, locally on the Beam DirectRunner. Run it
# again and the cached components are reused.
demo: $(VENV)/.installed
	$(VENV)/bin/python -m pipelines.run_local --output_dir=work/digits

# Benchmarks (14 to 17 minutes on 2 cores): tables and plots under docs/benchmarks/.
# BENCH_ARGS=--parts=memory re-runs one part alone (parts: benchmarks/run.py).
BENCH_ARGS ?=
bench: $(VENV)/.installed
	$(VENV)/bin/python -m benchmarks.run $(BENCH_ARGS)

test: test-tfx test-latest test-oldest test-keras2-tf215 test-keras2-latest

test-tfx: $(VENV)/.installed
	$(VENV)/bin/python -m pytest tests $(PYTEST_ARGS)

test-latest: $(LATEST)/.installed
	$(LATEST)/bin/python -m pytest tests/accumulator $(PYTEST_ARGS)

test-oldest: $(OLDEST)/.installed
	$(OLDEST)/bin/python -m pytest tests/accumulator $(PYTEST_ARGS)

test-keras2-tf215: $(KERAS2_TF215)/.installed
	$(KERAS2_TF215)/bin/python -m pytest tests/keras2 $(PYTEST_ARGS)

test-keras2-latest: $(KERAS2_LATEST)/.installed
	TF_USE_LEGACY_KERAS=1 $(KERAS2_LATEST)/bin/python -m pytest tests/keras2 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(LATEST) $(OLDEST) $(KERAS2_TF215) $(KERAS2_LATEST) *.egg-info
