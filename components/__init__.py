"""TFX components: `AccumulatingTrainer`, a drop-in Trainer with gradient accumulation.

`component.py` declares it, `executor.py` runs it, `fn_args_utils.py` builds
what the user's run_fn sees, `settings.py` resolves accumulation settings and
`noise_scale.py` records the gradient noise scale a run measured.
"""

if __name__ != "tfx_gradient_accumulator.components":   # `import components` from a checkout's root: a second copy
    raise ImportError(f"`import {__name__}` would load the library a second time under another name; "
                      "import tfx_gradient_accumulator.components instead.")

from tfx_gradient_accumulator.components.component import AccumulatingTrainer

__all__ = ["AccumulatingTrainer"]
