"""GradientCache(gather_across_replicas=True) on 2 worker processes (MultiWorkerMirroredStrategy
on 127.0.0.1): the global batch's negatives on every worker, as one device on the global batch.
"""

import keras

from tests.accumulator import contrastive_models as cm
from tests.accumulator import reference as ref
from tests.accumulator.multiworker import load_result, run_cluster

WORKER = "tests.accumulator.gradient_cache_worker"


def _one_device(batch=64):
    model = cm.built("two_tower")
    model.compile(optimizer=keras.optimizers.SGD(2.0))
    model.fit(cm.interactions(), batch_size=batch, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


def test_two_workers_gathered_train_like_one_device_on_the_global_batch(tmp_path):
    codes, output, result = run_cluster(tmp_path / "out", "--gather", 1, module=WORKER)
    assert codes == [0, 0], output[-3000:]
    expected = _one_device()
    weights, iterations = result
    assert iterations == 8                                  # 256 samples / 64, 2 epochs
    assert ref.max_abs_diff(weights, expected) <= 1e-5
    other, _ = load_result(tmp_path / "out", 1)
    assert ref.max_abs_diff(other, weights) == 0.0           # the workers agree
    # Control: each worker scoring its own 32 samples lands elsewhere.
    codes, output, alone = run_cluster(tmp_path / "alone", "--gather", 0, module=WORKER)
    assert codes == [0, 0], output[-3000:]
    assert ref.max_abs_diff(alone[0], expected) > 1e-3
