"""The scale P each optimizer's update_step applies, recomputed in numpy (float64) from the
gradients it was given: the references of `accumulator.noise.preconditioning`'s tests (both Keras)."""

import numpy as np


def adam_scale(grads, beta_2=0.999, eps=1e-7, on_corrected=False, amsgrad=False):
    v, v_max = 0.0, 0.0
    for g in grads:
        v = beta_2 * v + (1 - beta_2) * np.square(g.astype("float64"))
        v_max = np.maximum(v_max, v)
    v = v_max if amsgrad else v
    correction = 1 - beta_2 ** len(grads)
    if on_corrected:
        return 1 / (np.sqrt(v / correction) + eps)
    return np.sqrt(correction) / (np.sqrt(v) + eps)


def adamax_scale(grads, beta_2=0.999, eps=1e-7):
    u = 0.0
    for g in grads:
        u = np.maximum(beta_2 * u, np.abs(g.astype("float64")))
    return 1 / (u + eps)


def rmsprop_scale(grads, rho=0.9, eps=1e-7, centered=False):
    v, mean = 0.0, 0.0
    for g in grads:
        v = rho * v + (1 - rho) * np.square(g.astype("float64"))
        mean = rho * mean + (1 - rho) * g.astype("float64")
    return 1 / np.sqrt((v - np.square(mean) if centered else v) + eps)


def adagrad_scale(grads, initial=0.1, eps=1e-7):
    total = initial + sum(np.square(g.astype("float64")) for g in grads)
    return 1 / np.sqrt(total + eps)
