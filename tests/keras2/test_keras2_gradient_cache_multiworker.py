"""Keras 2 GradientCache(gather_across_replicas=True) on 2 worker processes
(MultiWorkerMirroredStrategy on 127.0.0.1): every worker scores the global batch, so the
run lands on tf_keras' (and TFRS's) own large batch on one device at the global batch.
"""

import pytest

from tests import deltas
from tests.accumulator.multiworker import load_result, run_cluster
from tests.keras2 import test_keras2_gradient_cache as plain

WORKER = "tests.keras2.gradient_cache_worker"
pytestmark = pytest.mark.skipif(plain.k2 is None, reason="no Keras 2 here (tf_keras not installed)")


def _cluster(out, gather, tfrs=0):
    codes, output, result = run_cluster(out, "--gather", gather, "--tfrs", tfrs, "--batch", 64 if not tfrs else 32,
                                        module=WORKER)
    assert codes == [0, 0], output[-3000:]
    return result


@pytest.mark.apart      # 50 s; make test: 2 replicas in one process (test_keras2_gradient_cache.py)
def test_two_workers_gathered_train_like_keras2_large_batch_on_one_device(tmp_path):
    weights, iterations = _cluster(tmp_path / "out", 1)
    assert iterations == 8                                   # 256 samples / 64, 2 epochs
    expected = plain.large_batch(lambda: plain.k2.optimizers.SGD(2.0), plain.interactions())
    measured = deltas.max_abs_diff(weights, expected.get_weights())
    print(f"[measured] Keras 2, 2 workers gathered vs tf_keras' one-device large batch: max |dw| = {measured:.1e}")
    assert measured <= plain.TOLERANCE
    other, _ = load_result(tmp_path / "out", 1)
    assert deltas.max_abs_diff(other, weights) == 0.0        # the workers agree
    # Control: each worker scoring its own 32 samples lands elsewhere.
    alone, _ = _cluster(tmp_path / "alone", 0)
    assert deltas.max_abs_diff(alone, expected.get_weights()) > 1e-3


@pytest.mark.apart      # 40 s; make test: 2 replicas in one process (test_tfrs_gradient_cache.py)
def test_two_workers_gathered_tfrs_like_its_large_batch_on_one_device(tmp_path):
    tfrs_case = pytest.importorskip("tests.keras2.test_tfrs_gradient_cache")
    if not issubclass(tfrs_case.tfrs.models.Model, plain.k2.Model):
        pytest.skip("TFRS needs tf.keras to be Keras 2 (TF_USE_LEGACY_KERAS=1)")
    weights, iterations = _cluster(tmp_path / "out", 1, tfrs=1)
    assert iterations == 12                                  # 192 samples / 32, 2 epochs
    expected = tfrs_case.tutorial_model(**tfrs_case.WORKER_KWARGS)
    tfrs_case.train(expected, tfrs_case.BATCH, tfrs_case.k2.optimizers.Adagrad(0.1))
    measured = deltas.max_abs_diff(weights, expected.get_weights())
    print(f"[measured] TFRS, 2 workers gathered vs TFRS's one-device large batch: max |dw| = {measured:.1e}")
    assert measured <= tfrs_case.TOLERANCE
    assert deltas.max_abs_diff(load_result(tmp_path / "out", 1)[0], weights) == 0.0
