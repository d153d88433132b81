"""The gradient noise scale: its estimator, the window's sums that feed it, Adam's preconditioner.

`noise_scale` (the estimate B_simple and its smoothing), `window_noise` (the open window's
sums and what a checkpoint keeps of them), `preconditioning` (the inner optimizer's second
moment, for the noise scale of the steps Adam takes).

May import: core.
"""
