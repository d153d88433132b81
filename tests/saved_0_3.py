"""What version 0.3 saved of an optimizer measuring the noise scale, made from this version's
state (Keras 3 and Keras 2 alike): the loads of `window_noise.from_version_0_3` are tested on it."""

import numpy as np


def in_the_0_3_layout(optimizer, open_sq=7.0, open_preconditioned=3.0):
    """`optimizer.window_state()` as version 0.3 saved it: four scalar sums, the raw estimate's
    EMAs (the decayed sums times 1 - smoothing), weight, int64 count and moments, then with a
    preconditioner its sum and the preconditioned estimate's five. The open window's squared
    norms, which this version keeps elsewhere, are stand-ins."""
    measured, values = optimizer._state.saved.noise, optimizer.window_state()
    noise = [v for v in (measured.squares, measured.sums) if v is not None]
    estimates = [e for e in (measured.estimate, measured.preconditioned_estimate) if e is not None]
    first = [i for i, v in enumerate(optimizer.variables) if v is noise[0]][0]
    sums = values[first + len(noise) - 1]
    sums = list(sums) if measured.squares is None else [open_sq] + list(sums)
    old = [np.float32(v) for v in sums]
    for k, estimate in enumerate(estimates):
        vector = values[first + len(noise) + k]
        if k == 1:
            old.append(np.float32(open_preconditioned))
        kept = 1.0 - estimate.smoothing
        old += [np.float32(vector[0] * kept), np.float32(vector[1] * kept), np.float32(vector[2] * kept),
                np.int64(vector[3]), np.asarray(vector[4:], np.float64)]
    return values[:first] + old + values[first + len(noise) + len(estimates):]
