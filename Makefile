# `make demo` runs the local pipeline, `make test` the whole test suite, `make bench`
# the benchmarks. Each sets up what it needs on a fresh machine first.
PYTHON ?= python3
VENV := .venv
LATEST := .venv-tf-latest
OLDEST := .venv-oldest
PYTEST_ARGS ?=

export TF_CPP_MIN_LOG_LEVEL ?= 2
export KERAS_BACKEND := tensorflow
export PYTHONUNBUFFERED := 1

.PHONY: bench demo test test-tfx test-latest test-oldest setup setup-latest setup-oldest clean

setup: $(VENV)/.installed
setup-latest: $(LATEST)/.installed
setup-oldest: $(OLDEST)/.installed

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
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip install -q --upgrade pip
	$(LATEST)/bin/pip install -q -r constraints/tf-latest.txt pytest pytest-timeout portpicker
	$(LATEST)/bin/pip install -q --no-deps -e .
	touch $@

# The core library alone on the oldest supported TensorFlow and Keras.
$(OLDEST)/.installed: setup.py constraints/oldest.txt
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/pip install -q --upgrade pip
	$(OLDEST)/bin/pip install -q -r constraints/oldest.txt pytest pytest-timeout portpicker
	$(OLDEST)/bin/pip install -q --no-deps -e .
	touch $@

# The main job: the digits pipeline, locally on the Beam DirectRunner. Run it
# again and the cached components are reused.
demo: $(VENV)/.installed
	$(VENV)/bin/python -m pipelines.run_local --output_dir=work/digits

# Benchmarks (about 14 minutes on 2 cores): tables and plots under docs/benchmarks/.
# BENCH_ARGS=--parts=memory re-runs one part alone (parts: benchmarks/run.py).
BENCH_ARGS ?=
bench: $(VENV)/.installed
	$(VENV)/bin/python -m benchmarks.run $(BENCH_ARGS)

test: test-tfx test-latest test-oldest

test-tfx: $(VENV)/.installed
	$(VENV)/bin/python -m pytest tests $(PYTEST_ARGS)

test-latest: $(LATEST)/.installed
	$(LATEST)/bin/python -m pytest tests/accumulator $(PYTEST_ARGS)

test-oldest: $(OLDEST)/.installed
	$(OLDEST)/bin/python -m pytest tests/accumulator $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(LATEST) $(OLDEST) *.egg-info
