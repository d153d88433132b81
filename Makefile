# `make demo` runs the local pipeline (`make demo-retrieval` the second one), `make test`
# the whole test suite, `make bench` the benchmarks, `make docs` the manual (site/).
# Each sets up what it needs on a fresh machine first.
PYTHON ?= python3
VENV := .venv
LATEST := .venv-tf-latest
OLDEST := .venv-oldest
KERAS2_TF215 := .venv-keras2-tf215
KERAS2_LATEST := .venv-keras2-latest
PYTEST_ARGS ?=

# Each core environment runs on its own Python, so every minor version that setup.py
# admits (python_requires ">=3.9,<3.14") is tested once; the TFX stack needs 3.11.
# An interpreter is taken from pyenv's versions, else from PATH; override with e.g.
# `make test PYTHON_LATEST=/usr/bin/python3.13`.
OLDEST_PY := 3.9
KERAS2_TF215_PY := 3.10
KERAS2_LATEST_PY := 3.12
LATEST_PY := 3.13
python_for = $(or $(firstword $(wildcard $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions/$(1).*/bin/python$(1))),$(shell command -v python$(1) 2>/dev/null))
PYTHON_OLDEST ?= $(call python_for,$(OLDEST_PY))
PYTHON_KERAS2_TF215 ?= $(call python_for,$(KERAS2_TF215_PY))
PYTHON_KERAS2_LATEST ?= $(call python_for,$(KERAS2_LATEST_PY))
PYTHON_LATEST ?= $(call python_for,$(LATEST_PY))

export TF_CPP_MIN_LOG_LEVEL ?= 2
export KERAS_BACKEND := tensorflow
export PYTHONUNBUFFERED := 1

# The installer: uv, pinned (constraints/uv.txt), in an environment of its own. From the
# same pinned files it installs what pip did (the same versions) in a quarter of the
# time: the TFX stack's pinned set in 27 s against pip's 118 s. Its cache sits in the
# checkout (.uv-cache/), on the environments' filesystem, so the environments share its
# files as hard links instead of copies (one copy of each package on disk).
UV_ENV := .venv-uv
UV := $(UV_ENV)/bin/uv
export UV_CACHE_DIR := $(CURDIR)/.uv-cache
export UV_HTTP_TIMEOUT := 180

# Bytecode. The environments are installed without it (as uv installs: compiling every
# module of TensorFlow took about half of each install with pip); Python writes it at the first
# import of each module that runs, under .pycache/ (PYTHONPYCACHEPREFIX: the checkout
# and the environments stay as installed), and every later process reads it, this
# checkout's modules included (a test's subprocesses, the docs' blocks, the workers).
export PYTHONDONTWRITEBYTECODE :=
export PYTHONPYCACHEPREFIX := $(CURDIR)/.pycache

# A test target's output goes through `| $(PREFIX)`: each line starts with the target's
# name, so the two lanes of `make test` can be told apart; pipefail keeps pytest's status.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PREFIX = sed -u 's/^/[$@] /'

# An install of this checkout (uv pip install -e .) waits for any other to finish: the
# environments of `make test` are built two at a time, and each writes the checkout's
# egg-info.
INSTALL_LOCK := $(CURDIR)/.install.lock
LOCKED = flock $(INSTALL_LOCK)

.PHONY: bench demo demo-retrieval docs test test-core test-apart test-tfx test-tfx-2 test-latest test-latest-2 test-latest-3 test-oldest test-keras2-tf215 test-keras2-latest \
	setup setup-latest setup-oldest setup-keras2 clean

# $(call core_venv,DIR,CONSTRAINTS,PYTHON,VERSION,VARIABLE): a venv on Python VERSION
# with pinned TensorFlow/Keras, the test tools and the library (no TFX).
define core_venv
	@test -n "$(3)" || { echo "$(1) needs Python $(4), found neither in pyenv nor as python$(4) on PATH: install it, or set $(5)=/path/to/python$(4)" >&2; exit 1; }
	@$(3) -c 'import sys; v = "%d.%d" % sys.version_info[:2]; assert v == "$(4)", "$(5)=$(3) is Python " + v + ", $(1) needs $(4)"'
	rm -rf $(1)
	$(3) -m venv $(1)
	$(UV) pip install -q --python $(1)/bin/python -r $(2) pytest pytest-timeout portpicker
	$(LOCKED) $(UV) pip install -q --python $(1)/bin/python --no-deps -e .
	touch $(1)/.installed-py$(4)
endef

$(UV): constraints/uv.txt
	$(PYTHON) -m venv $(UV_ENV)
	$(UV_ENV)/bin/pip install -q -r constraints/uv.txt
	touch $@

setup: $(VENV)/.installed
setup-latest: $(LATEST)/.installed-py$(LATEST_PY)
setup-oldest: $(OLDEST)/.installed-py$(OLDEST_PY)
setup-keras2: $(KERAS2_TF215)/.installed-py$(KERAS2_TF215_PY) $(KERAS2_LATEST)/.installed-py$(KERAS2_LATEST_PY)

# The TFX 1.16 stack. tfx's metadata says Python < 3.11 while its libraries ship
# 3.11 wheels: the pinned set goes in first, as it is (--no-deps: no resolver, no lock,
# and no check of tfx's Python range); then the checkout with its extras, under the
# lock, where uv finds them installed (the lock held for seconds, not for the stack's
# install, which kept the other environments' installs of the checkout waiting). Plus
# TensorFlow Recommenders for the retrieval demo's TFRS module (its own constraints
# file says why --no-deps). pip stays in the environment for what uses it (the wheel's
# tests build and install the wheel with it).
$(VENV)/.installed: setup.py constraints/tfx-1.16.txt constraints/tfx-1.16-tfrs.txt | $(UV)
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "TFX 1.16 needs Python 3.11 here; got " + sys.version' 
	$(PYTHON) -m venv $(VENV)
	$(UV) pip install -q --python $(VENV)/bin/python --upgrade "pip<25" setuptools wheel
	$(UV) pip install -q --python $(VENV)/bin/python --no-deps -r constraints/tfx-1.16.txt
	$(LOCKED) $(UV) pip install -q --python $(VENV)/bin/python -c constraints/tfx-1.16.txt -e '.[tfx,test,bench,docs]'
	$(UV) pip install -q --python $(VENV)/bin/python --no-deps -r constraints/tfx-1.16-tfrs.txt
	touch $@

# The core library alone on the newest TensorFlow and Keras.
# Plus KerasHub for the conformance suite (its own constraints file says why --no-deps).
$(LATEST)/.installed-py$(LATEST_PY): setup.py constraints/tf-latest.txt constraints/tf-latest-conformance.txt | $(UV)
	$(call core_venv,$(LATEST),constraints/tf-latest.txt,$(PYTHON_LATEST),$(LATEST_PY),PYTHON_LATEST)
	$(UV) pip install -q --python $(LATEST)/bin/python --no-deps -r constraints/tf-latest-conformance.txt || { rm -f $@; exit 1; }

# The core library alone on the oldest supported TensorFlow and Keras.
$(OLDEST)/.installed-py$(OLDEST_PY): setup.py constraints/oldest.txt | $(UV)
	$(call core_venv,$(OLDEST),constraints/oldest.txt,$(PYTHON_OLDEST),$(OLDEST_PY),PYTHON_OLDEST)

# Keras 2 where it is built in: TF 2.15's tf.keras.
$(KERAS2_TF215)/.installed-py$(KERAS2_TF215_PY): setup.py constraints/keras2-tf215.txt | $(UV)
	$(call core_venv,$(KERAS2_TF215),constraints/keras2-tf215.txt,$(PYTHON_KERAS2_TF215),$(KERAS2_TF215_PY),PYTHON_KERAS2_TF215)

# Keras 2 on the newest TensorFlow: tf_keras, with TF_USE_LEGACY_KERAS=1 for the tests.
# tf_keras and TensorFlow Recommenders (for its tests) go in with --no-deps (their
# constraints file says why).
$(KERAS2_LATEST)/.installed-py$(KERAS2_LATEST_PY): setup.py constraints/keras2-latest.txt constraints/keras2-latest-no-deps.txt | $(UV)
	$(call core_venv,$(KERAS2_LATEST),constraints/keras2-latest.txt,$(PYTHON_KERAS2_LATEST),$(KERAS2_LATEST_PY),PYTHON_KERAS2_LATEST)
	$(UV) pip install -q --python $(KERAS2_LATEST)/bin/python --no-deps -r constraints/keras2-latest-no-deps.txt || { rm -f $@; exit 1; }

# The main job: the digits pipeline, locally on the Beam DirectRunner. Run it
# again and the cached components are reused.
# DEMO_ARGS=--micro_batch_size=16 trains the Trainer with the effective batch as fit's batch,
# each update split into micro-batches of 16 inside the step (or =auto: found by the run).
DEMO_ARGS ?=
demo: $(VENV)/.installed
	$(VENV)/bin/python -m tfx_gradient_accumulator.pipelines.run_local --output_dir=work/digits $(DEMO_ARGS)

# The second one: a two-tower retrieval model with in-batch negatives, trained by
# AccumulatingTrainer(gradient_cache=True) on synthetic clustered interactions; prints
# the held-out recall@10 and the Trainer's record.
demo-retrieval: $(VENV)/.installed
	$(VENV)/bin/python -m tfx_gradient_accumulator.pipelines.run_local --pipeline=retrieval --output_dir=work/retrieval

# Benchmarks (about 2.5 hours on 2 cores, 2 of them the auto_batch part): tables and plots
# under docs/benchmarks/. BENCH_ARGS=--parts=memory re-runs one part alone (parts:
# benchmarks/run.py); a cut auto_batch part goes on with `python -m benchmarks.auto_batch --resume`.
BENCH_ARGS ?=
bench: $(VENV)/.installed
	$(VENV)/bin/python -m benchmarks.run $(BENCH_ARGS)

# The manual: MkDocs with the API reference from docstrings, into site/. --strict turns
# every warning (a broken link, a page missing from the nav, an unknown API name) into
# an error; tests/test_docs.py builds it the same way and runs every python block.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/python -m mkdocs build --strict

# The five environments' eight lanes (the newest environment's tests in three, TFX's in
# two), TEST_JOBS at a time (the cores + 1). First the environments (three installs at a
# time; one that fails is tried again by its lanes, which fail), then the lanes,
# longest first, so that whichever finishes takes the next and the last to start are
# the shortest (make starts ready goals in the order given; with the installs as their
# prerequisites in the same make, it started a lane whose environment was ready before
# a longer one). -k runs
# every lane even when one fails. One lane more than the cores (three on two): a lane's
# pytest waits now and then (its subprocesses starting, a cluster's workers, files), and
# the extra lane fills those waits (DEVELOPERS.md, "How make test spends its time").
# Each line of output is prefixed with its lane's target; the installs of this checkout
# into each environment take turns (INSTALL_LOCK: they write the same egg-info).
TEST_JOBS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 2) + 1 )))
LANES := test-latest-2 test-latest test-tfx test-latest-3 test-oldest test-keras2-latest test-tfx-2 test-keras2-tf215
ENVIRONMENTS := $(VENV)/.installed $(LATEST)/.installed-py$(LATEST_PY) $(OLDEST)/.installed-py$(OLDEST_PY) \
	$(KERAS2_LATEST)/.installed-py$(KERAS2_LATEST_PY) $(KERAS2_TF215)/.installed-py$(KERAS2_TF215_PY)
test:
	-$(MAKE) -k -j3 $(ENVIRONMENTS)
	$(MAKE) -k -j$(TEST_JOBS) $(LANES)

test-core:
	$(MAKE) -k -j1 test-latest test-latest-2 test-latest-3 test-oldest test-keras2-tf215 test-keras2-latest

# Every-optimizer sweeps run in full in test-latest, their representative optimizers
# elsewhere (tests/sweeps.py). The library's own tests (tests/accumulator, tests/keras2)
# run in the four core environments; the TFX environment runs what needs TFX (the
# component, the pipelines, the docs, the benchmarks' code, the wheel) and the check
# that the library's private names exist in its Keras and TensorFlow.
# In two lanes: test-tfx the component and the pipelines, test-tfx-2 the rest (TFX_SECOND).
TFX_SECOND := tests/test_*.py tests/accumulator/test_seam.py tests/accumulator/test_tuning_as_installed.py
TFX_TESTS := tests/components tests/pipelines $(TFX_SECOND)
test-tfx: $(VENV)/.installed
	$(VENV)/bin/python -m pytest tests/components tests/pipelines -m "not apart and not sweep" $(PYTEST_ARGS) 2>&1 | $(PREFIX)

test-tfx-2: $(VENV)/.installed
	$(VENV)/bin/python -m pytest $(TFX_SECOND) -m "not apart and not sweep" $(PYTEST_ARGS) 2>&1 | $(PREFIX)

# What make test leaves out (`@pytest.mark.apart`: slow runs whose behaviour a test in
# make test covers too; DEVELOPERS.md, "Tests that run apart", names each), the newest
# Keras' every-optimizer sweeps, in the oldest Keras the library's files but its core
# (OLDEST_TESTS) and the replica runs of OLDEST_APART, and in TF 2.15's Keras 2 the
# GradientCache file, the runs of KERAS2_TF215_APART_RUNS and the sweeps.
test-apart: $(VENV)/.installed $(LATEST)/.installed-py$(LATEST_PY) $(KERAS2_LATEST)/.installed-py$(KERAS2_LATEST_PY) \
		$(OLDEST)/.installed-py$(OLDEST_PY) $(KERAS2_TF215)/.installed-py$(KERAS2_TF215_PY)
	$(VENV)/bin/python -m pytest $(TFX_TESTS) -m apart $(PYTEST_ARGS)
	$(LATEST)/bin/python -m pytest tests/accumulator -m "apart or sweep" $(PYTEST_ARGS)
	$(OLDEST)/bin/python -m pytest tests/accumulator $(OLDEST_TESTS:%=--ignore=%) -m "not sweep and not apart" $(PYTEST_ARGS)
	$(OLDEST)/bin/python -m pytest $(OLDEST_APART) -m "not sweep and not apart" $(PYTEST_ARGS)
	TF_USE_LEGACY_KERAS=1 $(KERAS2_LATEST)/bin/python -m pytest tests/keras2 -m apart $(PYTEST_ARGS)
	$(KERAS2_TF215)/bin/python -m pytest $(KERAS2_TF215_APART) $(KERAS2_TF215_APART_RUNS) -m "not apart" $(PYTEST_ARGS)
	$(KERAS2_TF215)/bin/python -m pytest tests/keras2 --ignore=$(KERAS2_TF215_APART) -m "sweep and not apart" $(PYTEST_ARGS)

# The newest Keras runs the library's tests, its sweeps over every optimizer apart (the
# representative optimizers run here and in the oldest: tests/sweeps.py). In three lanes
# of about equal minutes, so that the cores share the longest environment:
# test-latest-2 runs LATEST_SECOND (lookups, XLA, the conformance models, the
# micro-batch probe, several workers), test-latest-3 LATEST_THIRD (the noise scale,
# auto, micro_batch_size="auto", tuning, the check, the reductions), test-latest every other file (a new file
# lands there).
LATEST_SECOND := $(addprefix tests/accumulator/,test_lookups.py test_sparse.py test_xla.py test_xla_rows.py \
	test_conformance.py test_conformance_pairs.py test_micro_batch.py test_out_of_memory_recovery.py \
	test_multiworker.py test_gradient_cache_multiworker.py)
LATEST_THIRD := $(addprefix tests/accumulator/,test_noise_scale.py test_noise_scale_estimator.py test_check.py \
	test_auto_batch.py test_tuning.py test_tuning_fit.py test_tuning_effective_batch.py test_tuning_noise_scale.py \
	test_batch_target.py test_preconditioning.py test_gradient_cache_gather.py test_reductions.py \
	test_fit_auto_micro_batch.py test_fit_auto_micro_batch_distributed.py)
test-latest: $(LATEST)/.installed-py$(LATEST_PY)
	$(LATEST)/bin/python -m pytest tests/accumulator $(LATEST_SECOND:%=--ignore=%) $(LATEST_THIRD:%=--ignore=%) \
		-m "not apart and not sweep" $(PYTEST_ARGS) 2>&1 | $(PREFIX)

test-latest-2: $(LATEST)/.installed-py$(LATEST_PY)
	$(LATEST)/bin/python -m pytest $(LATEST_SECOND) -m "not apart and not sweep" $(PYTEST_ARGS) 2>&1 | $(PREFIX)

test-latest-3: $(LATEST)/.installed-py$(LATEST_PY)
	$(LATEST)/bin/python -m pytest $(LATEST_THIRD) -m "not apart and not sweep" $(PYTEST_ARGS) 2>&1 | $(PREFIX)

# The oldest Keras runs the library's core: the files whose paths go through what
# differs between Keras versions (private names, saving, compile and fit, XLA, mixed
# precision, the loss API GradientCache calls, replicas): about 11 of the 26 minutes its
# whole would take; make test-apart runs the rest there (callbacks and weighting among
# them: they use Keras' public API alone).
OLDEST_TESTS := $(addprefix tests/accumulator/,test_seam.py test_api.py test_optimizer.py test_exactness.py \
	test_window.py test_xla.py test_mixed_precision.py test_saving.py test_saving_before_training.py \
	test_mirrored.py test_gradient_cache.py test_flavours.py test_options.py test_fit_effective_batch.py \
	test_fit_effective_batch_mixed.py)
# Its replica runs keep the ones that meet the replicas' path (fit and a custom loop under
# the strategy, the one reduction per window, the refusal without merge_call, the saving
# under a strategy); the replica runs of OLDEST_APART (global clipping, the epoch's last
# window, uneven micro-batches, GradientCache's negatives) repeat that path with other
# inputs, and run there in make test-apart (about 90 s).
OLDEST_APART := tests/accumulator/test_mirrored.py::test_clipping_acts_on_the_global_gradient \
	tests/accumulator/test_mirrored.py::test_each_epochs_last_window_is_applied_across_replicas \
	tests/accumulator/test_mirrored.py::test_uneven_micro_batches_are_weighted_across_replicas \
	tests/accumulator/test_gradient_cache.py::test_mirrored_replicas_see_the_negatives_of_keras_large_batch_under_the_same_strategy
test-oldest: $(OLDEST)/.installed-py$(OLDEST_PY)
	$(OLDEST)/bin/python -m pytest $(OLDEST_TESTS) $(OLDEST_APART:%=--deselect=%) -m "not sweep and not apart" \
		$(PYTEST_ARGS) 2>&1 | $(PREFIX)

# TF 2.15's own Keras 2 runs tests/keras2 but its GradientCache file (KERAS2_TF215_APART,
# about 80 s of CPU): that file runs there in make test-apart, and in make test on
# tf_keras (the same Keras 2 lineage, TF 2.15's Keras 2.15 its source).
# Likewise the two-worker run and the second mirrored fit (KERAS2_TF215_APART_RUNS, about
# 45 s: the first mirrored fit meets the replicas' path there), and, as in the oldest
# Keras 3, the every-optimizer sweeps (tests/sweeps.py): tf_keras runs them all.
KERAS2_TF215_APART := tests/keras2/test_keras2_gradient_cache.py
KERAS2_TF215_APART_RUNS := tests/keras2/test_keras2.py::test_two_worker_fit_matches_one_device_large_batch \
	tests/keras2/test_fit_effective_batch_keras2_distributed.py::test_two_workers_train_the_one_device_large_batch \
	tests/keras2/test_keras2.py::test_mirrored_fit_of_an_embedding_with_repeated_ids_matches_keras_2s_large_batch
test-keras2-tf215: $(KERAS2_TF215)/.installed-py$(KERAS2_TF215_PY)
	$(KERAS2_TF215)/bin/python -m pytest tests/keras2 --ignore=$(KERAS2_TF215_APART) \
		$(KERAS2_TF215_APART_RUNS:%=--deselect=%) -m "not apart and not sweep" $(PYTEST_ARGS) 2>&1 | $(PREFIX)

test-keras2-latest: $(KERAS2_LATEST)/.installed-py$(KERAS2_LATEST_PY)
	TF_USE_LEGACY_KERAS=1 $(KERAS2_LATEST)/bin/python -m pytest tests/keras2 -m "not apart" $(PYTEST_ARGS) 2>&1 | $(PREFIX)

clean:
	rm -rf $(VENV) $(LATEST) $(OLDEST) $(KERAS2_TF215) $(KERAS2_LATEST) $(UV_ENV) .uv-cache *.egg-info site .pycache
